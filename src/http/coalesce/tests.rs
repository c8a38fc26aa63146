use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use futures::task::noop_waker_ref;
use http_body::Frame;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use proptest::prelude::*;

use super::*;

/// A socket that takes at most `limits[i]` bytes on its i-th write (cycling; 0 is "not now":
/// Pending), and records them.
struct Choppy {
    out: Vec<u8>,
    limits: Vec<usize>,
    calls: usize,
}

impl Choppy {
    fn limit(&mut self) -> usize {
        let l = self.limits[self.calls % self.limits.len()];
        self.calls += 1;
        l
    }
}

impl AsyncWrite for Choppy {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match this.limit() {
            0 => Poll::Pending,
            l => {
                let n = l.min(buf.len());
                this.out.extend_from_slice(&buf[..n]);
                Poll::Ready(Ok(n))
            }
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match this.limit() {
            0 => Poll::Pending,
            mut l => {
                let mut n = 0;
                for b in bufs {
                    let take = l.min(b.len());
                    this.out.extend_from_slice(&b[..take]);
                    n += take;
                    l -= take;
                }
                Poll::Ready(Ok(n))
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// Poll until ready (the socket's Pending is momentary here).
fn drive<T>(mut f: impl FnMut(&mut Context<'_>) -> Poll<T>) -> T {
    let mut cx = Context::from_waker(noop_waker_ref());
    for _ in 0..10_000 {
        if let Poll::Ready(v) = f(&mut cx) {
            return v;
        }
    }
    panic!("never ready");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Whatever the sizes of the writes and however the socket chops them, the socket gets
    /// every byte once, in order, no write is reported as 0 bytes, nothing is held over a
    /// flush, and no more than HOLD_MAX is ever held.
    #[test]
    fn bytes_arrive_in_order_and_whole_at_each_flush(
        writes in prop::collection::vec((0usize..40_000, any::<bool>()), 1..12),
        limits in prop::collection::vec(0usize..50_000, 1..6),
    ) {
        let mut limits = limits;
        if limits.iter().all(|l| *l == 0) {
            limits.push(1);
        }
        let mut s = Coalesce::new(Choppy { out: Vec::new(), limits, calls: 0 });
        let mut expected = Vec::new();
        for (i, (len, flush)) in writes.into_iter().enumerate() {
            let data: Vec<u8> = (0..len).map(|j| (i * 31 + j) as u8).collect();
            let mut off = 0;
            while off < data.len() {
                let n = drive(|cx| Pin::new(&mut s).poll_write(cx, &data[off..])).unwrap();
                prop_assert!(n > 0);
                off += n;
                prop_assert!(s.held.len() - s.sent <= HOLD_MAX);
            }
            expected.extend_from_slice(&data);
            if flush {
                drive(|cx| Pin::new(&mut s).poll_flush(cx)).unwrap();
                prop_assert_eq!(&s.inner.out, &expected);
            }
        }
        drive(|cx| Pin::new(&mut s).poll_shutdown(cx)).unwrap();
        prop_assert_eq!(&s.inner.out, &expected);
    }
}

/// A socket half that counts the writes that reach it.
struct Counted<S> {
    inner: S,
    writes: Arc<AtomicUsize>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write(cx, buf);
        if r.is_ready() {
            this.writes.fetch_add(1, Ordering::SeqCst);
        }
        r
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        if r.is_ready() {
            this.writes.fetch_add(1, Ordering::SeqCst);
        }
        r
    }

    /// As a TCP socket says.
    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// A gRPC answer's shape: one DATA frame, then trailers.
struct Answer {
    data: Option<Bytes>,
    trailers: Option<axum::http::HeaderMap>,
}

impl http_body::Body for Answer {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(d) = self.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(d))));
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }
}

/// Socket writes an HTTP/2 server makes for each of `answers` answers of `size` bytes, over a
/// socket wrapped in `Coalesce` or not.
async fn writes_per_answer(coalesce: bool, size: usize) -> f64 {
    const ANSWERS: usize = 20;
    let (client_io, server_io) = tokio::io::duplex(1 << 20);
    let writes = Arc::new(AtomicUsize::new(0));
    let counted = Counted {
        inner: server_io,
        writes: writes.clone(),
    };
    let svc = hyper::service::service_fn(move |_req: hyper::Request<Incoming>| async move {
        let mut trailers = axum::http::HeaderMap::new();
        trailers.insert("grpc-status", axum::http::HeaderValue::from_static("0"));
        Ok::<_, Infallible>(hyper::Response::new(Answer {
            data: Some(Bytes::from(vec![b'x'; size])),
            trailers: Some(trailers),
        }))
    });
    let server = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    let serving = if coalesce {
        tokio::spawn(server.serve_connection(TokioIo::new(Coalesce::new(counted)), svc))
    } else {
        tokio::spawn(server.serve_connection(TokioIo::new(counted), svc))
    };
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(client_io))
            .await
            .unwrap();
    tokio::spawn(conn);
    let mut answer = || {
        let req = hyper::Request::post("http://test/etcdserverpb.KV/Range")
            .body(String::new())
            .unwrap();
        let sent = send.send_request(req);
        async move {
            let mut body = sent.await.unwrap().into_body();
            let mut got = 0;
            let mut trailers = false;
            while let Some(frame) = http_body_util_frame(&mut body).await {
                match frame.into_data() {
                    Ok(d) => got += d.len(),
                    Err(f) => trailers |= f.is_trailers(),
                }
            }
            assert_eq!((got, trailers), (size, true));
        }
    };
    // The first answer also carries the connection's setup (SETTINGS and its ack).
    answer().await;
    let before = writes.load(Ordering::SeqCst);
    for _ in 0..ANSWERS {
        answer().await;
    }
    let per_answer = (writes.load(Ordering::SeqCst) - before) as f64 / ANSWERS as f64;
    serving.abort();
    per_answer
}

async fn http_body_util_frame(body: &mut Incoming) -> Option<Frame<Bytes>> {
    std::future::poll_fn(|cx| http_body::Body::poll_frame(Pin::new(&mut *body), cx))
        .await
        .map(|f| f.unwrap())
}

/// An etcd key of a 256-byte value makes a gRPC answer of about 330 bytes: `h2` wrote its
/// trailers apart (two writes per answer); coalesced, it is one. Larger answers write as
/// many times as before.
#[tokio::test]
async fn an_answer_under_a_kibibyte_is_one_write() {
    assert_eq!(writes_per_answer(false, 330).await, 2.0);
    assert_eq!(writes_per_answer(true, 330).await, 1.0);
    assert_eq!(writes_per_answer(true, 100).await, 1.0);
    assert_eq!(writes_per_answer(true, 8_000).await, 2.0);
    assert_eq!(writes_per_answer(false, 8_000).await, 2.0);
    // Three DATA frames (16 KiB at most each), then the trailers: a write each, as before.
    assert_eq!(writes_per_answer(true, 40_000).await, 4.0);
    assert_eq!(writes_per_answer(false, 40_000).await, 4.0);
}
