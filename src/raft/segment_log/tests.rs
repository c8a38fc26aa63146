//! The segment log against a model, torn tails and damage, purges past the end.

use super::*;
use proptest::prelude::*;

fn payload(index: u64, size: usize) -> Vec<u8> {
    (0..size).map(|i| (index as usize * 31 + i) as u8).collect()
}

fn records(from: u64, sizes: &[usize]) -> Vec<(u64, Vec<u8>)> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| (from + i as u64, payload(from + i as u64, n)))
        .collect()
}

fn newest_segment(dir: &Path) -> Option<PathBuf> {
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .collect();
    names.sort();
    names.pop()
}

#[test]
fn appended_entries_read_back_across_segments_and_after_a_reopen() {
    let tmp = tempfile::TempDir::new().unwrap();
    let log = SegmentLog::open_with(tmp.path(), None, 256).unwrap();
    log.append(&records(0, &[100, 100, 100, 7, 0, 300]))
        .unwrap();
    log.sync().unwrap();
    assert_eq!(log.span(), Some((0, 5)));
    assert_eq!(log.bytes(), 607);
    let all = log.read(0, 6, usize::MAX).unwrap();
    assert_eq!(
        all,
        records(0, &[100, 100, 100, 7, 0, 300])
            .into_iter()
            .map(|r| r.1)
            .collect::<Vec<_>>()
    );
    // The budget stops before the entry that passes it, but returns at least one.
    assert_eq!(log.read(0, 6, 150).unwrap().len(), 1);
    assert_eq!(log.read(5, 6, 1).unwrap().len(), 1);
    drop(log);
    let log = SegmentLog::open_with(tmp.path(), None, 256).unwrap();
    assert_eq!(log.span(), Some((0, 5)));
    assert_eq!(log.read(3, 100, usize::MAX).unwrap()[0], payload(3, 7));
}

#[test]
fn a_torn_tail_is_cut_and_damage_elsewhere_refuses_to_open() {
    let tmp = tempfile::TempDir::new().unwrap();
    let log = SegmentLog::open_with(tmp.path(), None, 1 << 20).unwrap();
    log.append(&records(1, &[50, 50, 50])).unwrap();
    log.sync().unwrap();
    drop(log);
    let seg = newest_segment(tmp.path()).unwrap();
    let len = std::fs::metadata(&seg).unwrap().len();
    // Half of the last record was written when the machine stopped.
    OpenOptions::new()
        .write(true)
        .open(&seg)
        .unwrap()
        .set_len(len - 20)
        .unwrap();
    let log = SegmentLog::open_with(tmp.path(), None, 1 << 20).unwrap();
    assert_eq!(log.span(), Some((1, 2)));
    // The log goes on from the cut.
    log.append(&records(3, &[10])).unwrap();
    drop(log);
    let log = SegmentLog::open_with(tmp.path(), None, 1 << 20).unwrap();
    assert_eq!(
        log.read(1, 4, usize::MAX).unwrap().last().unwrap(),
        &payload(3, 10)
    );
    drop(log);

    // A flipped byte in a segment that is not the newest is damage: refused.
    let tmp = tempfile::TempDir::new().unwrap();
    let log = SegmentLog::open_with(tmp.path(), None, 64).unwrap();
    log.append(&records(1, &[60, 60, 60])).unwrap();
    drop(log);
    let first = tmp.path().join(segment_name(1));
    let mut bytes = std::fs::read(&first).unwrap();
    bytes[HEADER + 3] ^= 0xff;
    std::fs::write(&first, bytes).unwrap();
    match SegmentLog::open_with(tmp.path(), None, 64) {
        Err(LogFileError::Corrupt { detail, .. }) => {
            assert!(detail.contains("checksum"), "{detail}")
        }
        other => panic!("expected damage, got {:?}", other.map(|l| l.span())),
    }
}

#[test]
fn a_purge_past_the_end_lets_the_log_start_over_above_it() {
    let tmp = tempfile::TempDir::new().unwrap();
    let log = SegmentLog::open_with(tmp.path(), None, 1 << 20).unwrap();
    log.append(&records(1, &[10, 10])).unwrap();
    // A snapshot installed at 100: everything up to it goes, the log goes on at 101.
    assert_eq!(log.purge(100).unwrap(), 20);
    assert_eq!(log.span(), None);
    log.append(&records(101, &[5])).unwrap();
    assert!(
        log.append(&records(103, &[5])).is_err(),
        "a hole is refused"
    );
    log.sync().unwrap();
    drop(log);
    let log = SegmentLog::open_with(tmp.path(), Some(100), 1 << 20).unwrap();
    assert_eq!(log.span(), Some((101, 101)));
    assert_eq!(
        std::fs::read_dir(tmp.path()).unwrap().count(),
        1,
        "the old segment is gone"
    );
}

#[derive(Clone, Debug)]
enum Op {
    Append(Vec<usize>),
    Truncate(u8),
    Purge(u8),
    /// Reopen, having lost the bytes written since the last sync but `keep` of them.
    Crash {
        keep: u16,
    },
    Sync,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => prop::collection::vec(0usize..90, 1..6).prop_map(Op::Append),
        1 => any::<u8>().prop_map(Op::Truncate),
        1 => any::<u8>().prop_map(Op::Purge),
        1 => any::<u16>().prop_map(|keep| Op::Crash { keep }),
        2 => Just(Op::Sync),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Against a model (a list of entries and a purge point): every read returns the
    /// model's entries, a crash loses only entries written since the last sync and keeps
    /// a prefix, and reopening finds what was there.
    /// With space reserved ahead of the records (`reserve`), a crash leaves the unsynced
    /// bytes as zeros (reserved space never written); without, it cuts the file.
    #[test]
    fn the_log_behaves_as_its_model(
        ops in prop::collection::vec(op(), 1..40),
        reserve in any::<bool>(),
    ) {
        let tmp = tempfile::TempDir::new().unwrap();
        let seg_bytes = 300;
        let reserve_bytes = if reserve { 64 } else { 0 };
        let open = |purged| SegmentLog::open_reserving(tmp.path(), purged, seg_bytes, reserve_bytes);
        let mut log = open(None).unwrap();
        // The readable entries (index, size) and the purge point.
        let mut model: Vec<(u64, usize)> = Vec::new();
        let mut purged: Option<u64> = None;
        let mut synced_len = 0usize;
        let mut synced_file: Option<(PathBuf, u64)> = None;
        for op in ops {
            let next = model.last().map_or(purged.map_or(0, |p| p + 1), |e| e.0 + 1);
            match op {
                Op::Append(sizes) => {
                    log.append(&records(next, &sizes)).unwrap();
                    model.extend(sizes.iter().enumerate().map(|(i, &n)| (next + i as u64, n)));
                }
                Op::Truncate(at) if !model.is_empty() => {
                    let k = at as usize % model.len();
                    log.truncate(model[k].0).unwrap();
                    model.truncate(k);
                    synced_len = synced_len.min(k);
                    synced_file = None;
                }
                Op::Purge(at) => {
                    let upto = next.saturating_sub(1) + (at as u64 % 5);
                    let upto = upto.saturating_sub(at as u64 % 7);
                    if purged.is_none_or(|p| p < upto) {
                        log.purge(upto).unwrap();
                        let before = model.len();
                        model.retain(|e| e.0 > upto);
                        synced_len = synced_len.saturating_sub(before - model.len());
                        purged = Some(upto);
                    }
                }
                Op::Sync => {
                    log.sync().unwrap();
                    synced_len = model.len();
                    synced_file = log.lock().segments.back().map(|s| (s.path.clone(), s.end));
                }
                Op::Crash { keep } => {
                    let written = log.lock().segments.back().map_or(0, |s| s.end);
                    drop(log);
                    // Lose part of what was written since the last sync, in the newest
                    // segment only (segments before it were synced when closed... or not:
                    // only tear when the newest file is the one last synced).
                    if let Some((seg, len)) = &synced_file
                        && newest_segment(tmp.path()).as_ref() == Some(seg)
                    {
                        let cut = *len + u64::from(keep) % (written - len + 1);
                        let file = OpenOptions::new().write(true).open(seg).unwrap();
                        if reserve {
                            let size = std::fs::metadata(seg).unwrap().len();
                            file.write_all_at(&vec![0; (size - cut) as usize], cut).unwrap();
                        } else {
                            file.set_len(cut).unwrap();
                        }
                    }
                    log = open(purged).unwrap();
                    let span = log.span();
                    if let Some((f, _)) = span {
                        prop_assert_eq!(Some(f), model.first().map(|e| e.0));
                    }
                    let kept = span.map_or(0, |(f, l)| (l - f + 1) as usize);
                    prop_assert!(kept >= synced_len.min(model.len()), "lost synced entries");
                    prop_assert!(kept <= model.len());
                    model.truncate(kept);
                    synced_len = kept;
                    synced_file = None;
                }
                _ => {}
            }
            let span = model.first().map(|f| (f.0, model.last().unwrap().0));
            prop_assert_eq!(log.span(), span);
            prop_assert_eq!(log.bytes(), model.iter().map(|e| e.1 as u64).sum::<u64>());
            if let Some((first, last)) = span {
                let got = log.read(first, last + 1, usize::MAX).unwrap();
                let want: Vec<Vec<u8>> = model.iter().map(|e| payload(e.0, e.1)).collect();
                prop_assert_eq!(got, want);
            }
        }
    }
}

#[test]
fn reserved_space_is_not_a_record_and_the_log_goes_on_after_it() {
    let tmp = tempfile::TempDir::new().unwrap();
    let log = SegmentLog::open_reserving(tmp.path(), None, 1 << 20, 4096).unwrap();
    log.append(&records(1, &[50, 50, 50])).unwrap();
    log.sync().unwrap();
    let seg = newest_segment(tmp.path()).unwrap();
    // The file was made a whole reservation long: an fdatasync has no size to journal.
    assert_eq!(std::fs::metadata(&seg).unwrap().len(), 4096);
    drop(log);
    let log = SegmentLog::open_reserving(tmp.path(), None, 1 << 20, 4096).unwrap();
    assert_eq!(log.span(), Some((1, 3)));
    // Kept, not cut as a torn tail, and the next record goes right after the last.
    assert_eq!(std::fs::metadata(&seg).unwrap().len(), 4096);
    log.append(&records(4, &[5000])).unwrap();
    assert_eq!(std::fs::metadata(&seg).unwrap().len(), 8192);
    drop(log);
    let log = SegmentLog::open_reserving(tmp.path(), None, 1 << 20, 4096).unwrap();
    assert_eq!(log.read(1, 5, usize::MAX).unwrap()[3], payload(4, 5000));

    // A closed segment keeps no reserved space (a build without reservations would call
    // zeros there damage); one left with zeros (a crash before its trim was synced) is not
    // damaged, and is trimmed when the log opens. (Reservations are clamped to the segment
    // size: 1000 here.)
    drop(log);
    let tmp = tempfile::TempDir::new().unwrap();
    let log = SegmentLog::open_reserving(tmp.path(), None, 1000, 4096).unwrap();
    log.append(&records(11, &[600])).unwrap();
    log.append(&records(12, &[600])).unwrap();
    log.append(&records(13, &[600])).unwrap();
    log.sync().unwrap();
    let first = tmp.path().join(segment_name(11));
    let records_end = 2 * (HEADER as u64 + 600);
    assert_eq!(std::fs::metadata(&first).unwrap().len(), records_end);
    drop(log);
    OpenOptions::new()
        .write(true)
        .open(&first)
        .unwrap()
        .set_len(2000)
        .unwrap();
    let log = SegmentLog::open_reserving(tmp.path(), None, 1000, 4096).unwrap();
    assert_eq!(log.span(), Some((11, 13)));
    assert_eq!(std::fs::metadata(&first).unwrap().len(), records_end);
    log.purge(10).unwrap();

    // Half a record written into reserved space, then zeros: a torn tail, cut.
    log.append(&records(14, &[30])).unwrap();
    drop(log);
    let seg = newest_segment(tmp.path()).unwrap();
    let file = OpenOptions::new().write(true).open(&seg).unwrap();
    let record_end = (HEADER + 600 + HEADER + 30) as u64;
    file.write_all_at(&[0; 10], record_end - 10).unwrap();
    let log = SegmentLog::open_reserving(tmp.path(), Some(10), 1000, 4096).unwrap();
    assert_eq!(log.span(), Some((11, 13)));
    log.append(&records(14, &[7])).unwrap();
    drop(log);
    let log = SegmentLog::open_reserving(tmp.path(), Some(10), 1000, 4096).unwrap();
    assert_eq!(log.read(11, 15, usize::MAX).unwrap()[3], payload(14, 7));
}
