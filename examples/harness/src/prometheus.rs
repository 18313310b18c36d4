//! Reading Prometheus text the way the benchmarks and tests need it: a metric family summed over
//! its label sets.

/// The sum of every sample on a line `keep` accepts (the value is the line's last field).
pub fn sum_where(text: &str, keep: impl Fn(&str) -> bool) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#') && keep(l))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
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
    }
}
