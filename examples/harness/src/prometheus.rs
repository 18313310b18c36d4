//! Reading Prometheus text the way the benchmarks and tests need it — one parser for all of
//! them: a metric family summed over its label sets, one series' value, the series of a family.

/// Every sample line: (series with its labels, value).
fn samples(text: &str) -> impl Iterator<Item = (&str, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series, value.trim().parse::<f64>().ok()?))
        })
}

/// The sum of every sample on a line `keep` accepts (the value is the line's last field).
pub fn sum_where(text: &str, keep: impl Fn(&str) -> bool) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#') && keep(l))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |sum, v| sum + v)
}

/// The value of exactly this series (`name{labels}` as exported, or a bare name).
pub fn value(text: &str, series: &str) -> Option<f64> {
    samples(text).find_map(|(s, v)| (s == series).then_some(v))
}

/// Every series starting with `prefix` (e.g. `"kvroute_alarm{"`), with its value.
pub fn series<'a>(text: &'a str, prefix: &'a str) -> impl Iterator<Item = (&'a str, f64)> + 'a {
    samples(text).filter(move |(s, _)| s.starts_with(prefix))
}

/// Every sample whose series starts with `prefix`, sorted by series: two processes list a
/// family's series in different orders.
pub fn sorted_series(text: &str, prefix: &str) -> Vec<(String, f64)> {
    let mut out: Vec<(String, f64)> = series(text, prefix)
        .map(|(s, v)| (s.to_owned(), v))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The sum of every sample whose series starts with `prefix` (e.g. `"vllm:request_success_total{"`
/// for one family over all its label sets).
pub fn sum(text: &str, prefix: &str) -> f64 {
    sum_where(text, |l| l.starts_with(prefix))
}

#[cfg(test)]
mod tests {
    #[test]
    fn sums_a_family_over_its_labels() {
        let text = "# HELP x_total a counter\nx_total{a=\"1\"} 2\nx_total{a=\"2\"} 3.5\nx_other 9\nx_total{a=\"3\"} NaNx\n";
        assert_eq!(super::sum(text, "x_total{"), 5.5);
        assert_eq!(super::sum(text, "y{"), 0.0);
        assert_eq!(super::sum_where(text, |l| l.contains("a=\"2\"")), 3.5);
        assert_eq!(super::value(text, "x_total{a=\"2\"}"), Some(3.5));
        assert_eq!(super::value(text, "x_total{a=\"3\"}"), None, "not a number");
        assert_eq!(super::value(text, "x_other"), Some(9.0));
        assert_eq!(
            super::value(text, "x_oth"),
            None,
            "the whole series, not a prefix"
        );
        let on: Vec<_> = super::series(text, "x_total{").collect();
        assert_eq!(
            on,
            vec![("x_total{a=\"1\"}", 2.0), ("x_total{a=\"2\"}", 3.5)]
        );
    }
}

/// The `q` quantile (0..1) of histogram `name` in `text` from its cumulative buckets: the upper
/// bound of the first bucket holding it (`None` without observations).
pub fn histogram_quantile(text: &str, name: &str, q: f64) -> Option<f64> {
    let prefix = format!("{name}_bucket{{le=\"");
    let mut buckets: Vec<(f64, f64)> = text
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&prefix)?;
            let (le, count) = rest.split_once("\"}")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, count.trim().parse().ok()?))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    buckets
        .iter()
        .find(|(_, count)| *count >= q * total)
        .map(|(le, _)| *le)
}

#[cfg(test)]
mod histogram_tests {
    use super::*;

    #[test]
    fn quantiles_come_from_the_cumulative_buckets() {
        let text = "# TYPE kvroute_hint_seconds histogram\n\
            kvroute_hint_seconds_sum 0.01\n\
            kvroute_hint_seconds_count 10\n\
            kvroute_hint_seconds_bucket{le=\"0.00001\"} 0\n\
            kvroute_hint_seconds_bucket{le=\"0.000025\"} 6\n\
            kvroute_hint_seconds_bucket{le=\"0.00005\"} 9\n\
            kvroute_hint_seconds_bucket{le=\"+Inf\"} 10\n";
        let q = |q| histogram_quantile(text, "kvroute_hint_seconds", q);
        assert_eq!(q(0.5), Some(0.000025));
        assert_eq!(q(0.9), Some(0.00005));
        assert_eq!(q(0.99), Some(f64::INFINITY));
        assert_eq!(histogram_quantile(text, "other", 0.5), None);
    }
}
