//! Watching the engines' queues during a run: samples `vllm:num_requests_waiting` from every
//! engine's `/metrics`, so a test can say how long any queue stayed above a threshold.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;

/// One engine's samples: when, and how many requests were waiting.
type Samples = Vec<(Instant, f64)>;

/// Samples of every engine's waiting queue, taken until [`QueueWatch::stop`].
pub struct QueueWatch {
    samples: Arc<Mutex<Vec<Samples>>>,
    task: JoinHandle<()>,
}

/// What one engine's queue did over the run.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueStats {
    /// Deepest queue seen.
    pub max_waiting: f64,
    /// Longest stretch of consecutive samples above the threshold.
    pub longest_over: Duration,
    /// Samples taken.
    pub samples: usize,
}

impl QueueWatch {
    /// Start sampling the engines at `addresses` every `interval`.
    pub fn start(http: reqwest::Client, addresses: Vec<String>, interval: Duration) -> Self {
        let samples = Arc::new(Mutex::new(vec![Vec::new(); addresses.len()]));
        let sink = Arc::clone(&samples);
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            loop {
                tick.tick().await;
                for (i, address) in addresses.iter().enumerate() {
                    let Some(waiting) = waiting(&http, address).await else {
                        continue;
                    };
                    sink.lock().unwrap_or_else(|e| e.into_inner())[i]
                        .push((Instant::now(), waiting));
                }
            }
        });
        QueueWatch { samples, task }
    }

    /// Stop sampling; per engine, the deepest queue and the longest time above `threshold`.
    pub fn stop(self, threshold: f64) -> Vec<QueueStats> {
        self.task.abort();
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        samples.iter().map(|s| stats(s, threshold)).collect()
    }
}

/// A stretch starts at its first sample above the threshold and ends at the first one at or below.
fn stats(samples: &[(Instant, f64)], threshold: f64) -> QueueStats {
    let mut longest = Duration::ZERO;
    let mut since: Option<Instant> = None;
    for &(at, waiting) in samples {
        match (waiting > threshold, since) {
            (true, None) => since = Some(at),
            (false, Some(start)) => {
                longest = longest.max(at - start);
                since = None;
            }
            _ => {}
        }
    }
    if let (Some(start), Some(&(last, _))) = (since, samples.last()) {
        longest = longest.max(last - start);
    }
    QueueStats {
        max_waiting: samples.iter().map(|s| s.1).fold(0.0, f64::max),
        longest_over: longest,
        samples: samples.len(),
    }
}

async fn waiting(http: &reqwest::Client, address: &str) -> Option<f64> {
    let text = crate::client::get_text(http, &format!("http://{address}/metrics")).await?;
    crate::prometheus::series(&text, "vllm:num_requests_waiting{")
        .map(|(_, v)| v)
        .reduce(|a, b| a + b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_stretch_above_the_threshold() {
        let t0 = Instant::now();
        let at = |ms: u64, w: f64| (t0 + Duration::from_millis(ms), w);
        let s = [
            at(0, 0.0),
            at(10, 5.0),
            at(20, 6.0),
            at(30, 2.0),
            at(40, 9.0),
            at(100, 9.0),
        ];
        let r = stats(&s, 4.0);
        assert_eq!(r.max_waiting, 9.0);
        assert_eq!(
            r.longest_over,
            Duration::from_millis(60),
            "open stretch at the end counts"
        );
        assert_eq!(stats(&s[..4], 4.0).longest_over, Duration::from_millis(20));
        assert_eq!(stats(&[], 4.0).longest_over, Duration::ZERO);
    }
}
