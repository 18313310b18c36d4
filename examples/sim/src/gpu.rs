//! The GPU an engine's running requests share, as continuous batching shares it: one step at a
//! time; a step computes up to `chunk_tokens` of waiting prefill (oldest request first, a long
//! prompt over several steps, as vLLM's chunked prefill does) and one token of every decoding
//! request, and lasts `step_us + prefill_us_per_token × prefill tokens + decode_us_per_seq ×
//! decoding requests`. So a prefill slows every neighbour's next token, prefills queue behind
//! each other, and a cache hit saves the whole fleet time, not only its own request.
//!
//! Steps are timed against a running clock, not by sleeping each one: tokio's timer rounds a
//! sleep up to the millisecond, and steps of a few milliseconds would otherwise run slow.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

/// How long a step takes.
#[derive(Debug, Clone, Copy)]
pub struct GpuConfig {
    /// A step's fixed cost (a decode step of one request), µs.
    pub step_us: u64,
    /// Per prompt token computed in the step, µs.
    pub prefill_us_per_token: u64,
    /// Per request decoding in the step, µs.
    pub decode_us_per_seq: u64,
    /// Prompt tokens computed per step at most (vLLM's `max_num_batched_tokens`).
    pub chunk_tokens: usize,
}

impl GpuConfig {
    /// How long a step computing `prefill` prompt tokens beside `decoding` requests lasts.
    fn step(&self, prefill: usize, decoding: usize) -> Duration {
        Duration::from_micros(
            self.step_us
                + self.prefill_us_per_token * prefill as u64
                + self.decode_us_per_seq * decoding as u64,
        )
    }
}

enum Job {
    Prefill {
        tokens: usize,
        done: oneshot::Sender<()>,
    },
    Decode {
        tokens: u32,
        each: mpsc::UnboundedSender<()>,
    },
}

/// A handle on one engine's GPU; its steps run on a task of their own.
#[derive(Clone)]
pub struct Gpu {
    jobs: mpsc::UnboundedSender<Job>,
}

impl Gpu {
    /// Start the GPU's step loop.
    pub fn start(config: GpuConfig) -> Self {
        let (jobs, rx) = mpsc::unbounded_channel();
        tokio::spawn(steps(config, rx));
        Gpu { jobs }
    }

    /// Compute `tokens` prompt tokens; returns at the end of the step that computes the last
    /// (the step that also yields the first output token). A prompt found whole in the cache
    /// still takes a step.
    pub async fn prefill(&self, tokens: usize) {
        let (done, finished) = oneshot::channel();
        if self.jobs.send(Job::Prefill { tokens, done }).is_ok() {
            let _ = finished.await;
        }
    }

    /// Decode `tokens` output tokens, one a step: the receiver gets `()` at the end of each.
    /// Dropping it stops the decode (a client gone).
    pub fn decode(&self, tokens: u32) -> mpsc::UnboundedReceiver<()> {
        let (each, rx) = mpsc::unbounded_channel();
        if tokens > 0 {
            let _ = self.jobs.send(Job::Decode { tokens, each });
        }
        rx
    }
}

/// Behind by more than this, the clock starts over: a stalled runtime does not buy a burst of
/// instant steps.
const MOST_BEHIND: Duration = Duration::from_millis(5);

async fn steps(config: GpuConfig, mut jobs: mpsc::UnboundedReceiver<Job>) {
    let mut prefills: VecDeque<(usize, oneshot::Sender<()>)> = VecDeque::new();
    let mut decodes: Vec<(u32, mpsc::UnboundedSender<()>)> = Vec::new();
    let mut clock = Instant::now();
    let add = |job, prefills: &mut VecDeque<_>, decodes: &mut Vec<_>| match job {
        Job::Prefill { tokens, done } => prefills.push_back((tokens, done)),
        Job::Decode { tokens, each } => decodes.push((tokens, each)),
    };
    loop {
        if prefills.is_empty() && decodes.is_empty() {
            let Some(job) = jobs.recv().await else {
                return;
            };
            add(job, &mut prefills, &mut decodes);
            clock = Instant::now();
        }
        while let Ok(job) = jobs.try_recv() {
            add(job, &mut prefills, &mut decodes);
        }
        let mut computed = 0;
        for (left, _) in prefills.iter_mut() {
            let take = (*left).min(config.chunk_tokens - computed);
            *left -= take;
            computed += take;
            if computed == config.chunk_tokens {
                break;
            }
        }
        let floor = Instant::now().checked_sub(MOST_BEHIND).unwrap_or(clock);
        clock = clock.max(floor) + config.step(computed, decodes.len());
        tokio::time::sleep_until(clock).await;
        while prefills.front().is_some_and(|(left, _)| *left == 0) {
            if let Some((_, done)) = prefills.pop_front() {
                let _ = done.send(());
            }
        }
        decodes.retain_mut(|(left, each)| {
            *left -= 1;
            each.send(()).is_ok() && *left > 0
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: GpuConfig = GpuConfig {
        step_us: 1000,
        prefill_us_per_token: 100,
        decode_us_per_seq: 0,
        chunk_tokens: 100,
    };

    /// A prefill alone takes its chunks' steps; two at once queue, the second finishing after
    /// both were computed.
    #[tokio::test(start_paused = true)]
    async fn prefills_share_the_steps_oldest_first() {
        let gpu = Gpu::start(CONFIG);
        let start = Instant::now();
        gpu.prefill(200).await;
        // Two steps of 100 tokens: 2 × (1 + 10) ms.
        assert_eq!(start.elapsed(), Duration::from_millis(22));
        let start = Instant::now();
        let second = async {
            tokio::task::yield_now().await;
            gpu.prefill(100).await;
            start.elapsed()
        };
        let (first, second) = tokio::join!(
            async {
                gpu.prefill(100).await;
                start.elapsed()
            },
            second
        );
        assert_eq!(first, Duration::from_millis(11));
        assert_eq!(second, Duration::from_millis(22));
    }

    /// A decoding request's token waits for a neighbour's prefill in the same step.
    #[tokio::test(start_paused = true)]
    async fn a_prefill_slows_a_neighbours_tokens() {
        let gpu = Gpu::start(CONFIG);
        let mut alone = gpu.decode(1);
        let start = Instant::now();
        alone.recv().await.unwrap();
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(1),
            "a decode step alone"
        );
        let mut tokens = gpu.decode(3);
        let start = Instant::now();
        let (first, ()) = tokio::join!(
            async {
                tokens.recv().await.unwrap();
                start.elapsed()
            },
            gpu.prefill(100)
        );
        assert_eq!(first, Duration::from_millis(11), "beside a 100-token chunk");
        tokens.recv().await.unwrap();
        assert_eq!(start.elapsed(), Duration::from_millis(12), "alone again");
        tokens.recv().await.unwrap();
        assert!(tokens.recv().await.is_none(), "three tokens, then done");
    }

    /// A prompt found whole in the cache still takes a step.
    #[tokio::test(start_paused = true)]
    async fn a_cached_prompt_takes_one_step() {
        let gpu = Gpu::start(CONFIG);
        let start = Instant::now();
        gpu.prefill(0).await;
        assert_eq!(start.elapsed(), Duration::from_millis(1));
    }
}
