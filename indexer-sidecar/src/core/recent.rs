//! A count of recent events that fades: what a prefix's share of the requests is made of. Exponential decay rather than a window: one number per
//! count, no burst falling off a window's edge at once.

use std::time::{Duration, Instant};

/// Time constant of the counts: long against a Poisson burst (a prefix asked once a second
/// sends three in one now and then), short against a change in what users ask.
pub const TAU: Duration = Duration::from_secs(20);

/// Events counted, each weighing e^(−age / [`TAU`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Recent {
    count: f64,
    at: Option<Instant>,
}

impl Recent {
    /// The count at `now`.
    pub fn at(&self, now: Instant) -> f64 {
        match self.at {
            Some(at) => self.count * fade(now.saturating_duration_since(at)),
            None => 0.0,
        }
    }

    /// One more event at `now`; the count then.
    pub fn add(&mut self, now: Instant) -> f64 {
        self.count = self.at(now) + 1.0;
        self.at = Some(self.at.map_or(now, |at| at.max(now)));
        self.count
    }
}

/// What an event `age` ago still weighs.
fn fade(age: Duration) -> f64 {
    (-age.as_secs_f64() / TAU.as_secs_f64()).exp()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_fades_by_e_each_time_constant() {
        let t = Instant::now();
        let mut r = Recent::default();
        assert_eq!(r.at(t), 0.0);
        r.add(t);
        assert_eq!(r.add(t), 2.0);
        assert!((r.at(t + TAU) - 2.0 / std::f64::consts::E).abs() < 1e-9);
        assert_eq!(r.at(t - TAU), 2.0, "a clock read before the last event");
        // A steady stream settles at its rate × the time constant.
        let mut steady = Recent::default();
        for i in 0..2_000 {
            steady.add(t + Duration::from_millis(100 * i));
        }
        let rate_tau = 10.0 * TAU.as_secs_f64();
        let end = steady.at(t + Duration::from_millis(100 * 1_999));
        assert!((end - rate_tau).abs() / rate_tau < 0.03, "{end}");
    }
}
