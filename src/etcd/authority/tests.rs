//! The shim over in-memory connections: client streams built frame by frame, their header
//! blocks encoded by an independent HPACK encoder (httlib-hpack) and decoded back, as h2 would,
//! by an independent decoder.

use std::collections::VecDeque;

use proptest::prelude::*;

use super::*;

/// A connection whose reads return `chunks` one by one (then end).
struct Chunks(VecDeque<Vec<u8>>);

impl AsyncRead for Chunks {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Some(mut chunk) = self.0.pop_front() {
            let n = chunk.len().min(buf.remaining());
            buf.put_slice(&chunk[..n]);
            if n < chunk.len() {
                self.0.push_front(chunk.split_off(n));
            }
        }
        Poll::Ready(Ok(()))
    }
}

/// Everything read through a shim over `chunks`, in reads of at most `read_size` bytes.
fn through(chunks: Vec<Vec<u8>>, read_size: usize) -> io::Result<Vec<u8>> {
    let chunks = chunks.into_iter().filter(|c| !c.is_empty()).collect();
    let mut shim = AuthorityShim::new(Chunks(chunks));
    let waker = futures::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    let mut out = Vec::new();
    let mut buf = vec![0u8; read_size.max(1)];
    loop {
        let mut rb = ReadBuf::new(&mut buf);
        match Pin::new(&mut shim).poll_read(&mut cx, &mut rb) {
            Poll::Ready(Ok(())) if rb.filled().is_empty() => return Ok(out),
            Poll::Ready(Ok(())) => out.extend_from_slice(rb.filled()),
            Poll::Ready(Err(e)) => return Err(e),
            Poll::Pending => panic!("an in-memory read is never pending"),
        }
    }
}

/// `bytes` cut at `cuts` (positions taken modulo its length).
fn split(bytes: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
    let mut at: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    at.extend([0, bytes.len()]);
    at.sort_unstable();
    at.dedup();
    at.windows(2).map(|w| bytes[w[0]..w[1]].to_vec()).collect()
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = BytesMut::new();
    put_head(&mut out, payload.len(), kind, flags, stream);
    out.put_slice(payload);
    out.to_vec()
}

const DATA: u8 = 0x0;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const WINDOW_UPDATE: u8 = 0x8;

/// A request as a client sends it.
#[derive(Clone, Debug)]
struct Request {
    /// Name, value, and httlib-hpack's encoding flags.
    fields: Vec<(Vec<u8>, Vec<u8>, u8)>,
    pad: Option<u8>,
    priority: Option<[u8; 5]>,
    /// Where the block is cut into CONTINUATION frames.
    cuts: Vec<usize>,
    data: Vec<u8>,
}

/// httlib-hpack's flags: Huffman name (1), Huffman value (2), with indexing (4), never indexed
/// (8), best format: use the tables (16). Indexing wins over never indexed.
fn encoding(flags: u8) -> u8 {
    let flags = flags & 0x1f;
    if flags & 0x04 != 0 {
        flags & !0x08
    } else {
        flags
    }
}

/// A client connection: the preface, SETTINGS, then each request (HEADERS, CONTINUATIONs,
/// DATA) with a PING or a WINDOW_UPDATE between them.
fn client_stream(requests: &[Request]) -> Vec<u8> {
    let mut enc = httlib_hpack::Encoder::default();
    let mut out = PREFACE.to_vec();
    out.extend(frame(SETTINGS, 0, 0, &[0, 3, 0, 0, 0, 100]));
    for (i, r) in requests.iter().enumerate() {
        let stream = 1 + 2 * i as u32;
        let mut block = Vec::new();
        for (n, v, f) in &r.fields {
            enc.encode((n.clone(), v.clone(), encoding(*f)), &mut block)
                .unwrap();
        }
        let pieces = split(&block, &r.cuts);
        let pieces = if pieces.is_empty() {
            vec![Vec::new()]
        } else {
            pieces
        };
        let end_stream = if r.data.is_empty() { END_STREAM } else { 0 };
        for (j, piece) in pieces.iter().enumerate() {
            let last = if j + 1 == pieces.len() {
                END_HEADERS
            } else {
                0
            };
            if j > 0 {
                out.extend(frame(CONTINUATION, last, stream, piece));
                continue;
            }
            let mut payload = Vec::new();
            let mut flags = end_stream | last;
            if let Some(pad) = r.pad {
                payload.push(pad);
                flags |= PADDED;
            }
            if let Some(p) = r.priority {
                payload.extend(p);
                flags |= PRIORITY;
            }
            payload.extend(piece);
            payload.extend(std::iter::repeat_n(0, usize::from(r.pad.unwrap_or(0))));
            out.extend(frame(HEADERS, flags, stream, &payload));
        }
        if !r.data.is_empty() {
            out.extend(frame(DATA, END_STREAM, stream, &r.data));
        }
        if i % 2 == 0 {
            out.extend(frame(PING, 0, 0, &[i as u8; 8]));
        } else {
            out.extend(frame(WINDOW_UPDATE, 0, 0, &[0, 0, 1, 0]));
        }
    }
    out
}

/// A frame or a whole header block, as the server understands it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Event {
    Headers {
        stream: u32,
        end_stream: bool,
        priority: Option<[u8; 5]>,
        fields: Vec<(Vec<u8>, Vec<u8>)>,
    },
    Frame {
        kind: u8,
        flags: u8,
        stream: u32,
        payload: Vec<u8>,
    },
}

/// What h2 would make of a client stream: its frames, header blocks decoded with one table
/// for the connection (httlib-hpack's decoder). Checks the framing of header blocks.
fn server_view(bytes: &[u8]) -> Vec<Event> {
    assert!(bytes.starts_with(PREFACE));
    let mut dec = httlib_hpack::Decoder::default();
    let mut events = Vec::new();
    // A header block begun: stream, END_STREAM, priority, fragment so far.
    type Begun = (u32, bool, Option<[u8; 5]>, Vec<u8>);
    let mut pending: Option<Begun> = None;
    let mut at = PREFACE.len();
    while at < bytes.len() {
        let head = Head::parse(&bytes[at..]).expect("a whole frame header");
        let payload = &bytes[at + HEAD_LEN..at + HEAD_LEN + head.len];
        at += HEAD_LEN + head.len;
        match head.kind {
            HEADERS => {
                assert!(pending.is_none(), "HEADERS inside a header block");
                assert!(head.len <= MAX_FRAME);
                let block = headers_frame(head, 0..payload.len(), payload).unwrap();
                let fragment = payload[block.fragments[0].clone()].to_vec();
                pending = Some((head.stream, block.end_stream, block.priority, fragment));
            }
            CONTINUATION => {
                assert!(head.len <= MAX_FRAME);
                let p = pending.as_mut().expect("CONTINUATION after HEADERS");
                assert_eq!(p.0, head.stream);
                p.3.extend_from_slice(payload);
            }
            kind => {
                assert!(pending.is_none(), "a frame inside a header block");
                events.push(Event::Frame {
                    kind,
                    flags: head.flags,
                    stream: head.stream,
                    payload: payload.to_vec(),
                });
                continue;
            }
        }
        if head.flags & END_HEADERS != 0 {
            let (stream, end_stream, priority, mut fragment) = pending.take().unwrap();
            let mut fields = Vec::new();
            dec.decode(&mut fragment, &mut fields).unwrap();
            events.push(Event::Headers {
                stream,
                end_stream,
                priority,
                fields: fields.into_iter().map(|(n, v, _)| (n, v)).collect(),
            });
        }
    }
    assert!(pending.is_none(), "the stream ends inside a header block");
    events
}

/// `events` with every invalid `:authority` replaced as the shim replaces it: the first
/// header block with an `:authority` decides; if that one is valid, nothing is.
fn mended(events: Vec<Event>) -> Vec<Event> {
    let first = authorities(&events).into_iter().flatten().next();
    if first.is_some_and(|a| Authority::try_from(a.as_str()).is_ok()) {
        return events;
    }
    events
        .into_iter()
        .map(|e| match e {
            Event::Headers {
                stream,
                end_stream,
                priority,
                fields,
            } => Event::Headers {
                stream,
                end_stream,
                priority,
                fields: fields
                    .into_iter()
                    .filter_map(|(n, v)| {
                        if n != b":authority" || Authority::try_from(v.as_slice()).is_ok() {
                            return Some((n, v));
                        }
                        usable_authority(&v).map(|a| (n, a.to_vec()))
                    })
                    .collect(),
            },
            other => other,
        })
        .collect()
}

const VALID: [&str; 5] = [
    "127.0.0.1:2379",
    "localhost",
    "[::1]:2379",
    "etcd-0.etcd.default.svc:2379",
    "user@host:1",
];
const INVALID: [&str; 7] = [
    "http://127.0.0.1:2379",
    "https://etcd.example:2379/v3",
    "#initially=[http://127.0.0.1:2379;http://127.0.0.1:22379]",
    "#initially=[unix://sock]",
    "",
    "http://",
    "a b",
];

fn request(authorities: impl Strategy<Value = String>) -> impl Strategy<Value = Request> {
    let extra = (
        proptest::collection::vec(b'a'..=b'z', 1..10),
        proptest::collection::vec(any::<u8>(), 0..40),
        any::<u8>(),
    );
    (
        (
            authorities,
            proptest::collection::vec(b'a'..=b'z', 1..20),
            proptest::collection::vec(any::<u8>(), 5),
        ),
        proptest::collection::vec(extra, 0..4),
        (
            proptest::option::of(0u8..20),
            proptest::option::of(any::<[u8; 5]>()),
            proptest::collection::vec(any::<usize>(), 0..3),
            proptest::collection::vec(any::<u8>(), 0..300),
        ),
    )
        .prop_map(
            |((authority, path, flags), extra, (pad, priority, cuts, data))| {
                let mut fields = vec![
                    (b":method".to_vec(), b"POST".to_vec(), flags[0]),
                    (b":scheme".to_vec(), b"http".to_vec(), flags[1]),
                    (
                        b":path".to_vec(),
                        [b"/".as_slice(), &path].concat(),
                        flags[0],
                    ),
                    (b":authority".to_vec(), authority.into_bytes(), flags[2]),
                    (
                        b"content-type".to_vec(),
                        b"application/grpc".to_vec(),
                        flags[3],
                    ),
                    (b"te".to_vec(), b"trailers".to_vec(), flags[4]),
                ];
                fields.extend(extra);
                Request {
                    fields,
                    pad,
                    priority,
                    cuts,
                    data,
                }
            },
        )
}

fn valid_authority() -> impl Strategy<Value = String> {
    proptest::sample::select(VALID.to_vec()).prop_map(String::from)
}

fn any_authority() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => valid_authority(),
        1 => proptest::sample::select(INVALID.to_vec()).prop_map(String::from),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Valid authorities only: byte for byte what was sent, however the stream is cut into
    /// reads.
    #[test]
    fn valid_streams_pass_byte_for_byte(
        requests in proptest::collection::vec(request(valid_authority()), 0..6),
        cuts in proptest::collection::vec(any::<usize>(), 0..20),
        read_size in prop_oneof![1usize..32, 32usize..20_000],
    ) {
        let sent = client_stream(&requests);
        let got = through(split(&sent, &cuts), read_size).unwrap();
        prop_assert_eq!(got, sent);
    }

    /// Any mix of valid and invalid authorities: h2 reads every field as sent, but each invalid
    /// authority mended (or left out), and every other frame as sent.
    #[test]
    fn invalid_authorities_are_mended(
        requests in proptest::collection::vec(request(any_authority()), 1..6),
        cuts in proptest::collection::vec(any::<usize>(), 0..20),
        read_size in prop_oneof![1usize..32, 32usize..20_000],
    ) {
        let sent = client_stream(&requests);
        let got = through(split(&sent, &cuts), read_size).unwrap();
        prop_assert_eq!(server_view(&got), mended(server_view(&sent)));
    }

    /// Any bytes after the preface: an answer or an error, never a panic or a hang.
    #[test]
    fn any_bytes_end_without_panic(
        body in proptest::collection::vec(any::<u8>(), 0..2000),
        cuts in proptest::collection::vec(any::<usize>(), 0..10),
        read_size in 1usize..5000,
    ) {
        let mut sent = PREFACE.to_vec();
        sent.extend(body);
        let _ = through(split(&sent, &cuts), read_size);
    }

    /// Frames of any kind, flags and payload, header blocks among them: never a panic.
    #[test]
    fn any_frames_end_without_panic(
        frames in proptest::collection::vec(
            (
                prop_oneof![Just(HEADERS), Just(CONTINUATION), Just(DATA), Just(PUSH_PROMISE), any::<u8>()],
                any::<u8>(),
                0u32..4,
                proptest::collection::vec(any::<u8>(), 0..60),
            ),
            0..20,
        ),
        cuts in proptest::collection::vec(any::<usize>(), 0..10),
        read_size in 1usize..5000,
    ) {
        let mut sent = PREFACE.to_vec();
        for (kind, flags, stream, payload) in frames {
            sent.extend(frame(kind, flags, stream, &payload));
        }
        let _ = through(split(&sent, &cuts), read_size);
    }

    /// Not HTTP/2: untouched.
    #[test]
    fn other_protocols_pass_untouched(
        body in proptest::collection::vec(any::<u8>(), 0..500),
        cuts in proptest::collection::vec(any::<usize>(), 0..10),
        read_size in 1usize..600,
    ) {
        for head in [&b"POST /v3/kv/range HTTP/1.1\r\nhost: h\r\n\r\n"[..], b"PRI * HTTP/2.0\r\n\r\nXX", b""] {
            let mut sent = head.to_vec();
            sent.extend(&body);
            if sent.starts_with(PREFACE) {
                continue;
            }
            prop_assert_eq!(through(split(&sent, &cuts), read_size).unwrap(), sent);
        }
    }
}

/// A plain request: literal fields with incremental indexing (as Go's encoder sends them).
fn go_request(authority: &str) -> Request {
    let f = 0x04;
    Request {
        fields: vec![
            (b":method".to_vec(), b"POST".to_vec(), f | 0x10),
            (b":scheme".to_vec(), b"http".to_vec(), f | 0x10),
            (
                b":path".to_vec(),
                b"/etcdserverpb.Maintenance/Status".to_vec(),
                f | 0x13,
            ),
            (
                b":authority".to_vec(),
                authority.as_bytes().to_vec(),
                f | 0x13,
            ),
            (
                b"content-type".to_vec(),
                b"application/grpc".to_vec(),
                f | 0x13,
            ),
            (b"te".to_vec(), b"trailers".to_vec(), f | 0x13),
        ],
        pad: None,
        priority: None,
        cuts: Vec::new(),
        data: vec![0; 5],
    }
}

fn authorities(events: &[Event]) -> Vec<Option<String>> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Headers { fields, .. } => Some(
                fields
                    .iter()
                    .find(|(n, _)| n == b":authority")
                    .map(|(_, v)| String::from_utf8_lossy(v).into_owned()),
            ),
            Event::Frame { .. } => None,
        })
        .collect()
}

#[test]
fn etcdctls_authority_is_mended_and_so_are_its_repeats() {
    // The second and third requests repeat the first's fields from the table (one byte each).
    let bad = go_request("http://127.0.0.1:2379");
    let sent = client_stream(&[bad.clone(), bad.clone(), go_request("127.0.0.1:2379"), bad]);
    let got = through(vec![sent.clone()], 16_384).unwrap();
    let view = server_view(&got);
    assert_eq!(
        authorities(&view),
        vec![Some("127.0.0.1:2379".to_string()); 4]
    );
    assert_eq!(view, mended(server_view(&sent)));

    let sent = client_stream(&[go_request(
        "#initially=[https://etcd-0:2379;https://etcd-1:2379]",
    )]);
    let got = through(vec![sent], 100).unwrap();
    assert_eq!(
        authorities(&server_view(&got)),
        vec![Some("etcd-0:2379".to_string())]
    );

    // Nothing usable: the field is left out.
    let sent = client_stream(&[go_request("unix:///var/run/etcd.sock")]);
    let got = through(vec![sent], 100).unwrap();
    assert_eq!(authorities(&server_view(&got)), vec![None]);
}

/// A connection whose first request names a valid authority is passed through from then on,
/// byte for byte, whatever it sends later (h2 judges a later invalid one, as without the
/// shim): a gRPC channel sends the authority it was made for on every request.
#[test]
fn the_first_valid_authority_turns_the_shim_off() {
    let sent = client_stream(&[
        go_request("127.0.0.1:2379"),
        go_request("http://127.0.0.1:2379"),
        go_request("127.0.0.1:2379"),
    ]);
    let got = through(vec![sent.clone()], 100).unwrap();
    assert_eq!(got, sent);
}

#[test]
fn a_large_rewritten_block_is_cut_into_frames() {
    let mut r = go_request("http://h:1");
    r.fields.push((b"big".to_vec(), vec![b'x'; 40_000], 0));
    r.cuts = vec![10_000, 20_000, 30_000];
    r.priority = Some([0, 0, 0, 0, 7]);
    r.pad = Some(9);
    let sent = client_stream(&[r]);
    let got = through(vec![sent.clone()], 7_000).unwrap();
    let view = server_view(&got);
    assert_eq!(view, mended(server_view(&sent)));
    // HEADERS, then CONTINUATIONs, each at most 16384 bytes, the last alone with END_HEADERS.
    let mut at = PREFACE.len() + HEAD_LEN + 6;
    let mut kinds = Vec::new();
    while at < got.len() {
        let head = Head::parse(&got[at..]).unwrap();
        kinds.push((head.kind, head.flags & END_HEADERS != 0, head.len));
        at += HEAD_LEN + head.len;
    }
    assert_eq!(kinds[0], (HEADERS, false, MAX_FRAME));
    assert_eq!(kinds[1], (CONTINUATION, false, MAX_FRAME));
    assert!(matches!(kinds[2], (CONTINUATION, true, n) if n < MAX_FRAME));
    assert_eq!(kinds[3].0, DATA);
}

#[test]
fn out_of_place_or_oversized_header_frames_close_the_connection() {
    let settings = [PREFACE.as_slice(), &frame(SETTINGS, 0, 0, &[])].concat();
    let closes = |frames: &[Vec<u8>]| {
        let sent = [settings.clone(), frames.concat()].concat();
        let e = through(vec![sent], 4096).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        e.to_string()
    };
    let header = frame(HEADERS, 0, 1, &[0x82]);
    assert!(closes(&[frame(CONTINUATION, END_HEADERS, 1, &[0x82])]).contains("outside"));
    assert!(closes(&[header.clone(), frame(DATA, 0, 1, b"x")]).contains("inside"));
    assert!(closes(&[header.clone(), frame(CONTINUATION, END_HEADERS, 3, &[])]).contains("inside"));
    assert!(closes(&[frame(PUSH_PROMISE, END_HEADERS, 1, &[0, 0, 0, 2])]).contains("PUSH_PROMISE"));
    assert!(closes(&[frame(HEADERS, END_HEADERS | PADDED, 1, &[5, 0x82])]).contains("shorter"));
    assert!(closes(&[frame(HEADERS, END_HEADERS | PRIORITY, 1, &[0, 0])]).contains("shorter"));
    // A block over 64 KiB, in frames h2 would take one by one.
    let mut big = vec![header];
    big.extend(std::iter::repeat_n(
        frame(CONTINUATION, 0, 1, &[0x82; 16_000]),
        5,
    ));
    assert!(closes(&big).contains("over"));
    // Rewriting, a block whose fields come to more than 64 KiB (one byte each, from the table).
    let mut r = go_request("http://h:1");
    r.fields.push((b"x".to_vec(), vec![b'y'; 4000], 0x04));
    let mut sent = client_stream(&[r]);
    let mut refs = vec![0xbe; 30];
    refs.insert(0, 0x82);
    sent.extend(frame(HEADERS, END_HEADERS | END_STREAM, 101, &refs));
    assert!(
        through(vec![sent], 4096)
            .unwrap_err()
            .to_string()
            .contains("over")
    );
}

#[test]
fn a_block_that_does_not_decode_turns_the_shim_off() {
    // Index 0 does not decode: that block, and everything after it (an invalid authority
    // too), goes to h2 as it was.
    let mut sent = [
        PREFACE.as_slice(),
        &frame(SETTINGS, 0, 0, &[]),
        &frame(HEADERS, END_HEADERS, 1, &[0x80]),
    ]
    .concat();
    let later = client_stream(&[go_request("http://h:1")]);
    sent.extend_from_slice(&later[PREFACE.len()..]);
    assert_eq!(through(vec![sent.clone()], 4096).unwrap(), sent);
}

#[test]
fn usable_authorities() {
    for (sent, usable) in [
        ("http://127.0.0.1:2379", Some("127.0.0.1:2379")),
        (
            "https://etcd.example:2379/v3?x=1",
            Some("etcd.example:2379"),
        ),
        ("HTTP://h", Some("h")),
        ("http://[::1]:2379", Some("[::1]:2379")),
        ("#initially=[http://a:1;http://b:2]", Some("a:1")),
        ("#initially=[https://a:1]", Some("a:1")),
        ("#initially=[]", None),
        ("unix:///run/etcd.sock", None),
        ("http://", None),
        ("a b", None),
        ("", None),
        ("/x://h:1", None),
    ] {
        assert_eq!(
            usable_authority(sent.as_bytes()),
            usable.map(str::as_bytes),
            "{sent}"
        );
    }
}
