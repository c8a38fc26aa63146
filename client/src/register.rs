//! The light-weight lease ([`crate::lwlease`]) run over a real register: a leasecore key
//! written with plain PUT and read with GET (no compare-and-set), or a file on a shared file
//! system replaced atomically.
//!
//! [`LightLease`] performs each [`Step`] the pure [`Contender`] asks for: a read or a write of
//! the register, or a sleep, and reports its completion with the time on this process's
//! monotonic clock. The timing parameter δ must bound every register operation here (a
//! request round trip to leasecore, a file replace): an operation that takes longer is
//! reported as [`RegisterError::TooSlow`], since past δ the algorithm's safety argument no
//! longer holds, and the lease is treated as lost.
//!
//! # What it must not do
//! Decide anything about the lease: it only carries out steps and times them.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::{Clock, SystemClock};
use crate::lwlease::{Contender, Stamp, Step, Timing};
use crate::types::MonoMillis;
use crate::{Client, ClientError};

/// Why a register operation failed.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("the register holds something that is not a stamp: {0}")]
    Corrupt(String),
    #[error("a register operation took {took_ms} ms, longer than delta ({delta_ms} ms)")]
    TooSlow { took_ms: u64, delta_ms: u64 },
}

/// A single read/write register: no compare-and-set.
pub trait Register {
    /// The current stamp (`None`: never written).
    fn read(&self) -> impl Future<Output = Result<Option<Stamp>, RegisterError>> + Send;
    /// Replace the stamp.
    fn write(&self, stamp: &Stamp) -> impl Future<Output = Result<(), RegisterError>> + Send;
}

/// A leasecore key as the register: linearizable GET, plain PUT.
pub struct KvRegister {
    client: Arc<Client>,
    key: String,
}

impl KvRegister {
    pub fn new(client: Arc<Client>, key: impl Into<String>) -> Self {
        KvRegister {
            client,
            key: key.into(),
        }
    }
}

impl Register for KvRegister {
    async fn read(&self) -> Result<Option<Stamp>, RegisterError> {
        match self.client.get(&self.key, false).await? {
            None => Ok(None),
            Some(got) => serde_json::from_str(&got.kv.value)
                .map(Some)
                .map_err(|e| RegisterError::Corrupt(format!("{}: {e}", self.key))),
        }
    }

    async fn write(&self, stamp: &Stamp) -> Result<(), RegisterError> {
        let value = serde_json::to_string(stamp).expect("a stamp serializes");
        self.client.put(&self.key, &value, None, None).await?;
        Ok(())
    }
}

/// A file as the register: written to a temporary file beside it, then renamed over it (an
/// atomic replace on POSIX file systems), so a reader sees the old stamp or the new one.
pub struct FileRegister {
    path: PathBuf,
}

impl FileRegister {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        FileRegister { path: path.into() }
    }

    fn io(&self, source: std::io::Error) -> RegisterError {
        RegisterError::Io {
            path: self.path.display().to_string(),
            source,
        }
    }
}

impl Register for FileRegister {
    async fn read(&self) -> Result<Option<Stamp>, RegisterError> {
        match tokio::fs::read(&self.path).await {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| RegisterError::Corrupt(format!("{}: {e}", self.path.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(self.io(e)),
        }
    }

    async fn write(&self, stamp: &Stamp) -> Result<(), RegisterError> {
        let bytes = serde_json::to_vec(stamp).expect("a stamp serializes");
        let file_name = self
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        // Unique per writer and write: two writers never share a temporary file.
        let tmp = self
            .path
            .with_file_name(format!(".{file_name}.{}.{}", stamp.owner, stamp.seq));
        tokio::fs::write(&tmp, &bytes)
            .await
            .map_err(|e| self.io(e))?;
        tokio::fs::rename(&tmp, &self.path)
            .await
            .map_err(|e| self.io(e))
    }
}

/// What a contend or a renewal ended in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Held until this time on the runner's clock.
    Held(MonoMillis),
    /// Not held (a renewal found another stamp, or an operation broke the timing bound).
    Lost,
}

/// A light-weight lease on one register, for one contender.
pub struct LightLease<R> {
    register: R,
    contender: Contender,
    clock: Arc<dyn Clock>,
}

impl<R: Register> LightLease<R> {
    /// `id` must be unique among every process that may ever use the register.
    pub fn new(register: R, id: &str, timing: Timing) -> Self {
        Self::with_clock(register, id, timing, Arc::new(SystemClock::new()))
    }

    /// [`LightLease::new`] timed on `clock`.
    pub fn with_clock(register: R, id: &str, timing: Timing, clock: Arc<dyn Clock>) -> Self {
        // A fresh counter start per run: this process's stamps never repeat an earlier run's.
        let seq_start = clock.wall().0;
        LightLease {
            register,
            contender: Contender::new(id, timing, seq_start),
            clock,
        }
    }

    /// The clock `Held` times are on.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// Whether the lease is held now.
    pub fn holds(&self) -> bool {
        self.contender.holds(self.clock.mono())
    }

    /// Contend until held (a contender that keeps seeing the register change keeps waiting).
    pub async fn contend(&mut self) -> Result<Outcome, RegisterError> {
        let first = self.contender.contend();
        self.drive(first).await
    }

    /// Renew the lease this contender's id held in an earlier run, if the register still
    /// holds that run's stamp: `Lost` if it holds anything else (or nothing).
    pub async fn resume(&mut self) -> Result<Outcome, RegisterError> {
        let started = self.clock.mono();
        let id = self.contender.id().to_string();
        match self.timed(self.register.read(), started).await? {
            Some(stamp) if stamp.owner == id => {
                self.contender.resume(stamp);
                self.renew().await
            }
            _ => Ok(Outcome::Lost),
        }
    }

    /// Renew a held lease (call it before the `Held` time).
    pub async fn renew(&mut self) -> Result<Outcome, RegisterError> {
        let first = self.contender.renew();
        self.drive(first).await
    }

    async fn drive(&mut self, mut step: Step) -> Result<Outcome, RegisterError> {
        loop {
            step = match step {
                Step::Read => {
                    let started = self.clock.mono();
                    let value = self.timed(self.register.read(), started).await?;
                    self.contender.read_done(value, self.clock.mono())
                }
                Step::Write(stamp) => {
                    let started = self.clock.mono();
                    self.timed(self.register.write(&stamp), started).await?;
                    self.contender.write_done(self.clock.mono())
                }
                Step::SleepUntil(t) => {
                    let wait = self.clock.mono().until(t);
                    tokio::time::sleep(Duration::from_millis(wait)).await;
                    self.contender.woke(self.clock.mono())
                }
                Step::Hold(until) => return Ok(Outcome::Held(until)),
                Step::Lost | Step::Busy => return Ok(Outcome::Lost),
            };
        }
    }

    /// Run one register operation, refusing one slower than δ.
    async fn timed<T>(
        &self,
        op: impl Future<Output = Result<T, RegisterError>>,
        started: MonoMillis,
    ) -> Result<T, RegisterError> {
        let delta_ms = self.contender.timing().delta_ms();
        let result = op.await;
        let took_ms = started.until(self.clock.mono());
        if took_ms > delta_ms {
            return Err(RegisterError::TooSlow { took_ms, delta_ms });
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two contenders over one file, neither renewing: both hold in turn, never at once (the
    /// second only after the first's lease has lapsed and the register stayed quiet).
    #[tokio::test]
    async fn contenders_over_a_file_hold_in_turn_never_at_once() {
        let dir = std::env::temp_dir().join(crate::session::unique_name("lwlease-test"));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("register");
        let timing = Timing::new(100, 500).unwrap();
        let clock: Arc<dyn Clock> = Arc::new(SystemClock::new());
        let mut a = LightLease::with_clock(FileRegister::new(&path), "a", timing, clock.clone());
        let mut b = LightLease::with_clock(FileRegister::new(&path), "b", timing, clock.clone());
        let (ra, rb) = tokio::join!(a.contend(), b.contend());
        let span = |o: Outcome| match o {
            Outcome::Held(until) => (until.0 - timing.lease_ms(), until.0),
            Outcome::Lost => panic!("a contend ends held"),
        };
        let (mut first, mut second) = (span(ra.unwrap()), span(rb.unwrap()));
        if second.0 < first.0 {
            std::mem::swap(&mut first, &mut second);
        }
        assert!(second.0 >= first.1, "overlap: {first:?} and {second:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
