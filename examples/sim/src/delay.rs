//! Late events. A real engine publishes a scheduler step's KV events some time after the step:
//! its publisher is a queue drained by another thread, busy when the engine is. Measured on real
//! vLLM 0.32 under load (issue 11): p50 1.6 ms, p95 52 ms, max 666 ms after the engine stamped
//! them. A router reading them meanwhile sees the cache as it was: a new prefix not yet stored,
//! an evicted one still there. The simulator delays each batch by a log-normal draw with the
//! given median and 95th percentile, capped, and never reorders (a queue does not).

use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::publish::CacheChange;

/// How late events are published.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EventDelay {
    /// Median delay.
    pub p50: Duration,
    /// 95th percentile.
    pub p95: Duration,
    /// No batch is later than this.
    pub max: Duration,
}

impl EventDelay {
    /// Parse `P50,P95,MAX` in milliseconds (`0,0,0`: publish at once).
    pub fn parse(text: &str) -> Result<Self, String> {
        let ms: Vec<f64> = text
            .split(',')
            .map(|v| v.trim().parse::<f64>())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("event delay {text:?}: {e}"))?;
        let [p50, p95, max] = ms[..] else {
            return Err(format!("event delay {text:?}: want P50,P95,MAX in ms"));
        };
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        if !(ok(p50) && ok(p95) && ok(max) && p50 <= p95 && p95 <= max) {
            return Err(format!(
                "event delay {text:?}: want 0 ≤ P50 ≤ P95 ≤ MAX, in ms"
            ));
        }
        let d = |v: f64| Duration::from_secs_f64(v / 1e3);
        Ok(EventDelay {
            p50: d(p50),
            p95: d(p95),
            max: d(max),
        })
    }

    /// Whether batches are delayed at all.
    pub fn is_zero(&self) -> bool {
        self.max.is_zero()
    }

    /// The delay for a standard normal draw `z`.
    pub fn at(&self, z: f64) -> Duration {
        let p50 = self.p50.as_secs_f64();
        if p50 <= 0.0 {
            return Duration::ZERO;
        }
        // ln(delay) ~ N(ln p50, sigma), sigma from the 95th percentile (z = 1.645).
        let sigma = (self.p95.as_secs_f64() / p50).ln() / 1.645;
        Duration::from_secs_f64(p50 * (sigma * z).exp()).min(self.max)
    }
}

/// A standard normal draw from a xorshift state (Box–Muller).
fn normal(state: &mut u64) -> f64 {
    let mut uniform = || {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        ((*state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let (u1, u2) = (uniform(), uniform());
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// `rx`, each batch held back by a draw of `delay` counted from when it was sent, in order.
pub fn delayed(
    mut rx: mpsc::UnboundedReceiver<Vec<CacheChange>>,
    delay: EventDelay,
    seed: u64,
) -> mpsc::UnboundedReceiver<Vec<CacheChange>> {
    if delay.is_zero() {
        return rx;
    }
    let (due_tx, mut due_rx) = mpsc::unbounded_channel::<(Instant, Vec<CacheChange>)>();
    let (out_tx, out_rx) = mpsc::unbounded_channel();
    // Stamped as they arrive (the engine's step time), released by a second task, so a long
    // delay holds back the batches after it without stretching theirs.
    tokio::spawn(async move {
        let mut state = seed | 1;
        let mut last_due = Instant::now();
        while let Some(batch) = rx.recv().await {
            let due = (Instant::now() + delay.at(normal(&mut state))).max(last_due);
            last_due = due;
            if due_tx.send((due, batch)).is_err() {
                return;
            }
        }
    });
    tokio::spawn(async move {
        while let Some((due, batch)) = due_rx.recv().await {
            tokio::time::sleep_until(due).await;
            if out_tx.send(batch).is_err() {
                return;
            }
        }
    });
    out_rx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects() {
        let d = EventDelay::parse("1.6,52,666").unwrap();
        assert_eq!(d.p50, Duration::from_micros(1600));
        assert_eq!(d.max, Duration::from_millis(666));
        assert!(EventDelay::parse("0,0,0").unwrap().is_zero());
        for bad in ["1,2", "5,2,9", "1,2,x", "-1,2,3", "1,2,3,4"] {
            assert!(EventDelay::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn draws_follow_the_median_and_the_95th_percentile() {
        let d = EventDelay::parse("1.6,52,666").unwrap();
        let mut state = 42;
        let mut draws: Vec<Duration> = (0..20_000).map(|_| d.at(normal(&mut state))).collect();
        draws.sort();
        let q = |p: f64| draws[(p * draws.len() as f64) as usize].as_secs_f64() * 1e3;
        assert!((1.4..1.8).contains(&q(0.5)), "p50 {} ms", q(0.5));
        assert!((45.0..60.0).contains(&q(0.95)), "p95 {} ms", q(0.95));
        assert_eq!(*draws.last().unwrap(), d.max, "the tail is capped");
    }

    #[tokio::test]
    async fn batches_are_late_and_in_order() {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut rx = delayed(rx, EventDelay::parse("30,30,30").unwrap(), 7);
        let sent = Instant::now();
        for i in 0..3 {
            tx.send(vec![CacheChange::Removed(vec![i])]).unwrap();
        }
        for i in 0..3 {
            let batch = rx.recv().await.unwrap();
            assert_eq!(batch, vec![CacheChange::Removed(vec![i])]);
            assert!(sent.elapsed() >= Duration::from_millis(30));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let mut rx = delayed(rx, EventDelay::parse("0,0,0").unwrap(), 7);
        tx.send(vec![CacheChange::Restarted]).unwrap();
        assert_eq!(rx.try_recv().unwrap(), vec![CacheChange::Restarted]);
    }
}
