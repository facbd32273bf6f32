//! Small helpers the benchmarks share: the median of samples and the machine's load averages.

use std::fs;

/// The median of `values` (the mean of the middle two for an even count); NaN when there are none, so an
/// empty series can never pass for a measured zero.
pub(crate) fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let middle = sorted.len() / 2;
    if sorted.len() % 2 == 1 {
        sorted[middle]
    } else {
        (sorted[middle - 1] + sorted[middle]) / 2.0
    }
}

/// The 1, 5 and 15 minute load averages from `/proc/loadavg`, or "unknown".
pub(crate) fn load_average() -> String {
    fs::read_to_string("/proc/loadavg")
        .map(|text| {
            text.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|_| "unknown".to_owned())
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn the_median_takes_the_middle_or_the_mean_of_the_middle_two() {
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5, "median of 1..=4 is 2.5");
        assert_eq!(median(&[5.0, 1.0, 3.0]), 3.0, "median of 1, 3, 5 is 3");
        assert!(median(&[]).is_nan(), "no samples have no median");
    }
}
