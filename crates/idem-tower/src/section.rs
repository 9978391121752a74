//! [`Section`]: the work between a claim and its stored outcome, run to its end even when the
//! request that started it is dropped.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::telemetry::Boxed;

/// The section of a request from the claim to the stored outcome. It is polled inside the
/// request's own future, with no task of its own while the client waits; if the request's
/// future is dropped first (the client hung up), the section is handed to a task of its own to
/// finish, so the record is never left half-written (docs/contract.md §2.7).
///
/// Written by hand rather than spawned: a task per request cost every first request a spawn, a
/// wake-up of the request's task when it ended and, on a multi-thread runtime, often a wake-up
/// of an idle worker thread to steal it; handing off on drop keeps the guarantee for the rare
/// request whose client leaves. A panic inside the section is caught, as a spawned task's
/// would be, and answered by the caller.
pub(crate) struct Section<T: Send + 'static> {
    /// `None` once the section ended (or panicked): nothing is left to finish.
    work: Option<Boxed<'static, T>>,
}

/// The section panicked; its message went to the panic hook.
#[derive(Debug)]
pub(crate) struct Panicked;

impl<T: Send + 'static> Section<T> {
    pub(crate) fn new(work: Boxed<'static, T>) -> Self {
        Self { work: Some(work) }
    }
}

impl<T: Send + 'static> Future for Section<T> {
    type Output = Result<T, Panicked>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(work) = self.work.as_mut() else {
            panic!("a section polled after it ended");
        };
        // A panicking future is never polled again: `work` is dropped below.
        let polled = std::panic::catch_unwind(AssertUnwindSafe(|| work.as_mut().poll(cx)));
        match polled {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(output)) => {
                self.work = None;
                Poll::Ready(Ok(output))
            }
            Err(_) => {
                self.work = None;
                Poll::Ready(Err(Panicked))
            }
        }
    }
}

impl<T: Send + 'static> Drop for Section<T> {
    fn drop(&mut self) {
        let Some(work) = self.work.take() else {
            return;
        };
        // The request was dropped mid-section: the section goes on in a task of its own, its
        // answer unread. Without a runtime (it is shutting down) nothing could run it anyway.
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(work);
            }
            Err(_) => tracing::warn!("a request's section was dropped with its runtime"),
        }
    }
}

/// Runs `work`, turning a panic inside it into `Err(Panicked)`, so that the caller can let go
/// of what the work held (its claim, its transaction) before it answers. The work is dropped
/// once it panicked, and with it whatever it borrowed (the handler's `Tx` guard).
pub(crate) async fn catch_panic<F: Future>(work: F) -> Result<F::Output, Panicked> {
    let mut work = std::pin::pin!(work);
    std::future::poll_fn(|cx| {
        match std::panic::catch_unwind(AssertUnwindSafe(|| work.as_mut().poll(cx))) {
            Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(_) => Poll::Ready(Err(Panicked)),
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[tokio::test]
    async fn a_section_ends_with_its_output() {
        assert_eq!(Section::new(Box::pin(async { 7 })).await.unwrap(), 7);
    }

    #[tokio::test]
    async fn a_panic_in_a_section_is_its_answer() {
        let answer = Section::new(Box::pin(async {
            panic!("the handler failed");
            #[allow(unreachable_code)]
            ()
        }))
        .await;
        assert!(answer.is_err());
    }

    /// Dropped while its work waits, the section still runs to its end in a task.
    #[tokio::test]
    async fn a_dropped_section_still_runs_to_its_end() {
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let (done_tx, done) = tokio::sync::oneshot::channel::<()>();
        let finished = Arc::new(AtomicBool::new(false));
        let flag = finished.clone();
        let mut section = Box::pin(Section::new(Box::pin(async move {
            released.await.unwrap();
            flag.store(true, Ordering::SeqCst);
            done_tx.send(()).unwrap();
        })));
        // Started, then abandoned while it waits, as a request whose client hung up.
        assert!(futures_poll_once(section.as_mut()).await.is_pending());
        drop(section);
        release.send(()).unwrap();
        done.await.unwrap();
        assert!(finished.load(Ordering::SeqCst));
    }

    /// Polls `future` once.
    async fn futures_poll_once<F: Future + Unpin>(mut future: F) -> Poll<F::Output> {
        std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut future).poll(cx))).await
    }
}
