//! Heap bytes per idle Flease acceptor cell at 1,000,000 resources, counted by a counting
//! allocator (deterministic, unlike resident memory): the goal is under 200 bytes per idle
//! resource (133.5 when written: the slab cell with its name, a 4-byte index entry at the
//! table's load, interned owners).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use leasecore::domain::flease::{
    Acceptor, Ballot, Envelope, FleaseConfig, Msg, Now, Protocol, Slot,
};
use leasecore::domain::types::{MonoMillis, WallMillis};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::SeqCst);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::SeqCst);
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

#[test]
fn heap_bytes_per_idle_cell() {
    const N: usize = 1_000_000;
    let cfg = FleaseConfig::default();
    let at = Now {
        wall: WallMillis(1_000_000_000),
        mono: MonoMillis(1_000_000),
    };
    let mut acceptor = Acceptor::new(
        1,
        cfg,
        Now {
            mono: MonoMillis(0),
            ..at
        },
    );
    // Names and messages are built outside the measured span.
    let msgs: Vec<Envelope> = (0..N)
        .map(|i| Envelope {
            proto: Protocol::Flease,
            resource: format!("shard/{i:08}"),
            from: 2,
            to: 1,
            sent_at: at.wall,
            body: Msg::Write {
                k: Ballot {
                    era: 1,
                    counter: 1,
                    boot: 1,
                    node: 2,
                },
                value: Slot::Lease {
                    owner: format!("worker-{}", i % 100),
                    expires: WallMillis(at.wall.0 + 10_000),
                    epoch: 7,
                },
            },
        })
        .collect();
    let before = LIVE.load(Ordering::SeqCst);
    for m in &msgs {
        acceptor.on_message(m, at);
    }
    let after = LIVE.load(Ordering::SeqCst);
    let per_cell = (after - before) as f64 / N as f64;
    println!("heap bytes per leased acceptor cell: {per_cell:.1}");
    assert_eq!(acceptor.len(), N);
    assert!(per_cell < 200.0, "{per_cell} bytes per cell");
}
