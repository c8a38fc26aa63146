//! The only place in leasecore that reads a clock.
//!
//! Everything else takes time as an argument ([`MonoMillis`], [`WallMillis`]). Shells hold a
//! [`Clock`] and pass readings into the pure cores; tests hold a [`ManualClock`] and move time
//! by hand, so time-dependent rules are tested deterministically in microseconds.

#![allow(clippy::disallowed_methods)] // the one place that reads clocks

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::types::{MonoMillis, WallMillis};

/// A source of time readings.
pub trait Clock: Send + Sync + 'static {
    /// Milliseconds on this process's monotonic clock.
    fn mono(&self) -> MonoMillis;
    /// Milliseconds since the Unix epoch on the wall clock.
    fn wall(&self) -> WallMillis;
}

/// The real clocks of this machine.
#[derive(Clone, Debug)]
pub struct SystemClock {
    /// The origin of [`MonoMillis`] readings for this process.
    origin: Instant,
}

impl SystemClock {
    pub fn new() -> Self {
        SystemClock {
            origin: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn mono(&self) -> MonoMillis {
        MonoMillis(self.origin.elapsed().as_millis() as u64)
    }

    fn wall(&self) -> WallMillis {
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        WallMillis(since_epoch.as_millis() as u64)
    }
}

/// A clock moved by hand, for tests of the shells.
#[derive(Clone, Debug, Default)]
pub struct ManualClock {
    mono: Arc<AtomicU64>,
    wall: Arc<AtomicU64>,
}

impl ManualClock {
    pub fn new() -> Self {
        Self::default()
    }

    /// Move both clocks forward by `ms`.
    pub fn advance(&self, ms: u64) {
        self.mono.fetch_add(ms, Ordering::SeqCst);
        self.wall.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn mono(&self) -> MonoMillis {
        MonoMillis(self.mono.load(Ordering::SeqCst))
    }

    fn wall(&self) -> WallMillis {
        WallMillis(self.wall.load(Ordering::SeqCst))
    }
}
