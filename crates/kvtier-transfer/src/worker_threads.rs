//! OS worker threads that run chunked copy jobs, oldest job first, several threads per job.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// A transfer cut into chunks that any worker may run.
pub(crate) trait ChunkedJob: Send + Sync {
    /// Claims the next chunk; `None` once every chunk has been claimed.
    fn claim(&self) -> Option<usize>;
    /// Runs one claimed chunk.
    fn run(&self, chunk: usize);
    /// Number of chunks (0: nothing to copy).
    fn chunks(&self) -> usize;
    /// Completes the job: publishes or releases what it holds and tells the requester. Called
    /// once, by whoever finished the last chunk (or at launch when there are none).
    fn finish(&self);
}

/// Counts jobs that are queued or running, so callers can wait until a queue is idle.
#[derive(Debug, Default)]
pub(crate) struct JobTracker {
    active: Mutex<usize>,
    idle: Condvar,
}

impl JobTracker {
    fn lock(&self) -> MutexGuard<'_, usize> {
        self.active.lock().unwrap_or_else(|e| e.into_inner())
    }
    /// A token that counts one job until dropped.
    pub(crate) fn start(self: &Arc<Self>) -> JobToken {
        *self.lock() += 1;
        JobToken(Arc::clone(self))
    }
    pub(crate) fn active(&self) -> usize {
        *self.lock()
    }
    pub(crate) fn wait_idle(&self) {
        let mut n = self.lock();
        while *n > 0 {
            n = self.idle.wait(n).unwrap_or_else(|e| e.into_inner());
        }
    }
    /// Like `wait_idle`, giving up at `deadline`; whether the queue went idle.
    pub(crate) fn wait_idle_until(&self, deadline: std::time::Instant) -> bool {
        let mut n = self.lock();
        while *n > 0 {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            n = self
                .idle
                .wait_timeout(n, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }
}

/// Held by a job for its whole life; dropping it (job finished, cancelled or discarded at
/// shutdown) counts the job out.
#[derive(Debug)]
pub(crate) struct JobToken(Arc<JobTracker>);

impl Drop for JobToken {
    fn drop(&mut self) {
        let mut n = self.0.lock();
        *n -= 1;
        if *n == 0 {
            self.0.idle.notify_all();
        }
    }
}

struct Shared {
    queue: Mutex<VecDeque<Arc<dyn ChunkedJob>>>,
    wake: Condvar,
    shutdown: AtomicBool,
}

/// A fixed set of named OS threads serving one queue.
pub(crate) struct WorkerThreads {
    shared: Arc<Shared>,
    handles: Vec<JoinHandle<()>>,
}

impl fmt::Debug for WorkerThreads {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerThreads")
            .field("threads", &self.handles.len())
            .finish()
    }
}

impl WorkerThreads {
    /// Starts `threads` workers named `kvtier-{name}-{i}`, at scheduling niceness `nice`
    /// (0 = unchanged; positive values yield the CPU to other queues' workers).
    pub(crate) fn new(name: &str, threads: usize, nice: i32) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(VecDeque::new()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
        });
        let mut handles = Vec::with_capacity(threads);
        for i in 0..threads.max(1) {
            let shared = Arc::clone(&shared);
            let handle = std::thread::Builder::new()
                .name(format!("kvtier-{name}-{i}"))
                .spawn(move || {
                    if nice != 0 {
                        set_thread_nice(nice);
                    }
                    worker_loop(&shared);
                })?;
            handles.push(handle);
        }
        Ok(Self { shared, handles })
    }

    pub(crate) fn threads(&self) -> usize {
        self.handles.len()
    }

    /// A handle that queues jobs on these workers (held by jobs that continue in another job).
    pub(crate) fn handle(&self) -> WorkerHandle {
        WorkerHandle(Arc::clone(&self.shared))
    }

    /// Jobs queued and not yet fully claimed.
    pub(crate) fn queued(&self) -> usize {
        self.lock_queue().len()
    }

    fn lock_queue(&self) -> MutexGuard<'_, VecDeque<Arc<dyn ChunkedJob>>> {
        self.shared.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Queues jobs on a [`WorkerThreads`]; after the threads shut down, jobs are dropped instead (which
/// releases what they hold and tells their requesters).
#[derive(Clone)]
pub(crate) struct WorkerHandle(Arc<Shared>);

impl fmt::Debug for WorkerHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("WorkerHandle")
    }
}

impl WorkerHandle {
    /// Queues `job` behind the ones already there, or finishes it at once if it has no chunks.
    pub(crate) fn launch(&self, job: Arc<dyn ChunkedJob>) {
        self.enqueue(job, false);
    }

    /// Queues `job` ahead of every queued job: the next phase of a request that was already
    /// at the head (a load's device copies after its disk reads), so requests still finish in
    /// the order they came.
    pub(crate) fn launch_first(&self, job: Arc<dyn ChunkedJob>) {
        self.enqueue(job, true);
    }

    fn enqueue(&self, job: Arc<dyn ChunkedJob>, first: bool) {
        if job.chunks() == 0 {
            job.finish();
            return;
        }
        let mut q = self.0.queue.lock().unwrap_or_else(|e| e.into_inner());
        if self.0.shutdown.load(Ordering::Acquire) {
            drop(q);
            drop(job);
            return;
        }
        if first {
            q.push_front(job);
        } else {
            q.push_back(job);
        }
        drop(q);
        self.0.wake.notify_all();
    }
}

impl Drop for WorkerThreads {
    /// Stops the workers after their current chunk; queued jobs are discarded, which releases
    /// their pins and pages and tells their requesters the queue shut down.
    fn drop(&mut self) {
        let discarded: Vec<_> = {
            let mut q = self.lock_queue();
            // Under the queue lock, so no handle can queue a job after the drain.
            self.shared.shutdown.store(true, Ordering::Release);
            q.drain(..).collect()
        };
        self.shared.wake.notify_all();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
        drop(discarded);
    }
}

fn worker_loop(shared: &Shared) {
    loop {
        let (job, chunk) = {
            let mut q = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if shared.shutdown.load(Ordering::Acquire) {
                    return;
                }
                match q.front().map(|j| (Arc::clone(j), j.claim())) {
                    Some((job, Some(chunk))) => break (job, chunk),
                    Some((_, None)) => {
                        q.pop_front();
                    }
                    None => q = shared.wake.wait(q).unwrap_or_else(|e| e.into_inner()),
                }
            }
        };
        job.run(chunk);
    }
}

/// Lowers (positive `nice`) the calling thread's scheduling priority. Best effort: a failure is
/// logged, the worker runs at normal priority.
fn set_thread_nice(nice: i32) {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) };
    // SAFETY: setpriority on our own thread id with a plain integer priority.
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS as _, tid as libc::id_t, nice) };
    if rc != 0 {
        tracing::warn!(nice, error = %std::io::Error::last_os_error(), "could not set worker priority");
    }
}
