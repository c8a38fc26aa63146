//! One socket write per HTTP/2 answer: the write side of the HTTP/2 (etcd API) port's
//! connections.
//!
//! `h2` buffers the frames it sends and flushes when its buffer can take no more. Over a
//! socket that says it writes vectored, it keeps any DATA payload of 256 bytes or more out of
//! its buffer (to hand it to `writev` without a copy) and then takes no further frame until
//! that payload is written. A gRPC answer is HEADERS, DATA and the trailers' HEADERS: with a
//! message of 256 bytes or more (one etcd key of a 256-byte value is one), the trailers waited
//! for a `writev` of their own. That was two system calls, two TCP segments and two wake-ups
//! of the client per answer, the second one for 10 bytes.
//!
//! [`Coalesce`] says it does *not* write vectored. `h2` then copies every payload under
//! 1 KiB into its buffer, trailers and all, and flushes the answer once. A larger payload is
//! still kept out of `h2`'s buffer, and offered as a second write after the buffer. The first
//! write of a flush (the buffer) is held; a second write goes out with it in one `writev`,
//! without being copied. So answers under 1 KiB take one system call where they took two,
//! and larger ones take two, as before.
//!
//! The same port serves HTTP/1 (the JSON gateway, probes). There hyper, told the socket does
//! not write vectored, copies a body into its head's buffer (its "flatten" strategy) and
//! writes once: the same one system call per answer as before.
//!
//! # Invariants
//! - Bytes reach the socket in the order they were written, each exactly once. A write
//!   reported done is held (at most [`HOLD_MAX`] bytes) or written. A flush or shutdown sends
//!   what is held first.
//! - A write is never reported as 0 bytes done (`h2` would take that for a closed socket).
//!
//! # What it must not do
//! Hold bytes across a flush, hold more than [`HOLD_MAX`], or copy a write that follows one
//! it holds: that one goes out at once, after what is held.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The most a [`Coalesce`] holds between a write and the next write or flush. `h2`'s buffer
/// starts at 16 KiB, so its contents usually fit; a larger write goes out at once.
pub const HOLD_MAX: usize = 32 * 1024;

/// A capacity kept between answers: a held buffer that grew past it (a large header block)
/// is let go once sent, so an idle connection keeps no more than this.
const KEEP_CAPACITY: usize = 4 * 1024;

/// A stream whose small writes wait for the next write or the flush, to go out together.
pub struct Coalesce<S> {
    inner: S,
    held: Vec<u8>,
    /// How much of `held` is already written.
    sent: usize,
}

impl<S> Coalesce<S> {
    pub fn new(inner: S) -> Self {
        Coalesce {
            inner,
            held: Vec::new(),
            sent: 0,
        }
    }

    fn clear(&mut self) {
        self.held.clear();
        self.sent = 0;
        if self.held.capacity() > KEEP_CAPACITY {
            self.held = Vec::new();
        }
    }
}

impl<S: AsyncWrite + Unpin> Coalesce<S> {
    /// Write out everything held.
    fn poll_send_held(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.held.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.held[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.clear();
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Coalesce<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Coalesce<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        // `held` is emptied whenever all of it is sent, so empty means nothing is held.
        if this.held.is_empty() && buf.len() <= HOLD_MAX {
            // The first write since the last flush: held for whatever follows it.
            this.held.extend_from_slice(buf);
            return Poll::Ready(Ok(buf.len()));
        }
        // A second write (a payload `h2` kept out of its buffer), or one too large to hold:
        // out at once, after what is held, in one call.
        while this.sent < this.held.len() {
            let slices = [
                io::IoSlice::new(&this.held[this.sent..]),
                io::IoSlice::new(buf),
            ];
            let n = ready!(Pin::new(&mut this.inner).poll_write_vectored(cx, &slices))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            let held = this.held.len() - this.sent;
            if n > held {
                this.clear();
                return Poll::Ready(Ok(n - held));
            }
            this.sent += n;
        }
        this.clear();
        match ready!(Pin::new(&mut this.inner).poll_write(cx, buf))? {
            0 => Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
            n => Poll::Ready(Ok(n)),
        }
    }

    /// Not vectored: see the module's documentation for why `h2` must not be told otherwise.
    fn is_write_vectored(&self) -> bool {
        false
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_send_held(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_send_held(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
