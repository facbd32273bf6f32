//! Small helpers the benchmarks share: the median of samples, paired ratios and the machine's load averages.

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

/// Ratios of one series over a peer's, paired round by round, with their median and range.
///
/// Rounds that measure every stack once pair naturally: a slow phase of the machine that lands on one round
/// hits both sides of that round's ratio. The median of these ratios is therefore steadier than the ratio of
/// the two medians, and the lowest and highest say how firm either figure is.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PairedRatios {
    /// One ratio per round, in round order; NaN where the peer's figure was zero or either was not a number.
    pub(crate) per_round: Vec<f64>,
    /// The median of the finite ratios (NaN when there is none).
    pub(crate) median: f64,
    /// The lowest finite ratio (NaN when there is none).
    pub(crate) lowest: f64,
    /// The highest finite ratio (NaN when there is none).
    pub(crate) highest: f64,
}

impl PairedRatios {
    /// Divides `ours[i]` by `peer[i]` for every round both series have; a longer series' extra rounds are
    /// left out, since they have no partner.
    pub(crate) fn new(ours: &[f64], peer: &[f64]) -> PairedRatios {
        let per_round: Vec<f64> = ours
            .iter()
            .zip(peer)
            .map(|(ours, peer)| {
                if *peer > 0.0 && ours.is_finite() && peer.is_finite() {
                    ours / peer
                } else {
                    f64::NAN
                }
            })
            .collect();
        let finite: Vec<f64> = per_round
            .iter()
            .copied()
            .filter(|ratio| ratio.is_finite())
            .collect();
        let spread = Spread::of(&finite);
        PairedRatios {
            median: spread.median,
            lowest: spread.lowest,
            highest: spread.highest,
            per_round,
        }
    }
}

/// The lowest, median and highest of some samples; NaN for each when there are none.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Spread {
    pub(crate) lowest: f64,
    pub(crate) median: f64,
    pub(crate) highest: f64,
}

impl Spread {
    /// The spread of `values`.
    pub(crate) fn of(values: &[f64]) -> Spread {
        if values.is_empty() {
            return Spread {
                lowest: f64::NAN,
                median: f64::NAN,
                highest: f64::NAN,
            };
        }
        Spread {
            lowest: values.iter().copied().fold(f64::INFINITY, f64::min),
            median: median(values),
            highest: values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        }
    }

    /// Highest minus lowest as a fraction of the median: 0.34 means the rounds ranged over 34% of it.
    pub(crate) fn range_of_median(&self) -> f64 {
        (self.highest - self.lowest) / self.median
    }
}

/// A 95% interval for the median of `values` by the bootstrap: the median of 4,000 resamples (with replacement,
/// from a fixed seed so a report can be re-derived), and the 2.5th and 97.5th percentiles of those medians.
///
/// This says how far a median of noisy rounds can be trusted: a telemetry row "within 2% of off" is shown only
/// when this interval of its paired ratios lies inside 0.98 to 1.02. NaN for both ends when there are no
/// finite values.
pub(crate) fn median_interval(values: &[f64]) -> (f64, f64) {
    let finite: Vec<f64> = values
        .iter()
        .copied()
        .filter(|value| value.is_finite())
        .collect();
    if finite.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    const RESAMPLES: usize = 4_000;
    // xorshift64*: a fixed, dependency-free stream; the quality needed here is only "not patterned".
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    let mut sample = vec![0.0; finite.len()];
    let mut medians: Vec<f64> = (0..RESAMPLES)
        .map(|_| {
            for slot in sample.iter_mut() {
                *slot = finite[(next() % finite.len() as u64) as usize];
            }
            median(&sample)
        })
        .collect();
    medians.sort_by(f64::total_cmp);
    let at = |fraction: f64| medians[((RESAMPLES - 1) as f64 * fraction).round() as usize];
    (at(0.025), at(0.975))
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
    use super::{PairedRatios, Spread, median, median_interval};

    #[test]
    fn the_median_interval_holds_the_median_and_narrows_with_more_rounds() {
        let few: Vec<f64> = (0..10)
            .map(|index| 1.0 + 0.01 * f64::from(index % 5) - 0.02)
            .collect();
        let many: Vec<f64> = (0..200)
            .map(|index| 1.0 + 0.01 * f64::from(index % 5) - 0.02)
            .collect();
        let (few_low, few_high) = median_interval(&few);
        let (many_low, many_high) = median_interval(&many);
        assert!(
            few_low <= median(&few) && median(&few) <= few_high,
            "the interval {few_low}..{few_high} should hold the median {}",
            median(&few)
        );
        assert!(
            many_high - many_low <= few_high - few_low,
            "200 rounds ({many_low}..{many_high}) should not be looser than 10 ({few_low}..{few_high})"
        );
        assert!(
            few_low >= 0.98 && few_high <= 1.02,
            "resampled medians stay inside the samples: {few_low}..{few_high}"
        );
        let constant = median_interval(&[3.0; 7]);
        assert_eq!(constant, (3.0, 3.0), "identical rounds leave no doubt");
        let none = median_interval(&[f64::NAN]);
        assert!(
            none.0.is_nan() && none.1.is_nan(),
            "no finite rounds give no interval"
        );
    }

    #[test]
    fn the_median_takes_the_middle_or_the_mean_of_the_middle_two() {
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5, "median of 1..=4 is 2.5");
        assert_eq!(median(&[5.0, 1.0, 3.0]), 3.0, "median of 1, 3, 5 is 3");
        assert!(median(&[]).is_nan(), "no samples have no median");
    }

    #[test]
    fn paired_ratios_divide_round_by_round_and_report_their_median_and_range() {
        let ratios = PairedRatios::new(&[120.0, 150.0, 100.0], &[100.0, 100.0, 100.0]);
        assert_eq!(
            ratios.per_round,
            [1.2, 1.5, 1.0],
            "each round should be divided by the same round of the peer"
        );
        assert_eq!(ratios.median, 1.2, "the median of 1.2, 1.5 and 1.0 is 1.2");
        assert_eq!(ratios.lowest, 1.0, "the lowest ratio is 1.0");
        assert_eq!(ratios.highest, 1.5, "the highest ratio is 1.5");
    }

    #[test]
    fn a_median_of_ratios_can_differ_from_the_ratio_of_medians() {
        // The peer's fast second round pairs with ours: per round 1.2x, 1.05x and 1.125x, median 1.125x,
        // while the ratio of the medians (120 over 100) says 1.2x.
        let ours = [120.0, 210.0, 90.0];
        let peer = [100.0, 200.0, 80.0];
        let ratios = PairedRatios::new(&ours, &peer);
        assert!(
            (ratios.median - 1.125).abs() < 1e-12,
            "the median of the per-round ratios should be 1.125, got {}",
            ratios.median
        );
        assert!(
            (median(&ours) / median(&peer) - 1.2).abs() < 1e-12,
            "the ratio of medians of these series should be 1.2"
        );
        assert!(
            (ratios.lowest - 1.05).abs() < 1e-12 && (ratios.highest - 1.2).abs() < 1e-12,
            "the range should run from 1.05 to 1.2: {ratios:?}"
        );
    }

    #[test]
    fn rounds_without_a_usable_peer_figure_are_left_out_of_the_statistics() {
        let ratios = PairedRatios::new(&[100.0, 100.0, f64::NAN, 90.0], &[0.0, 50.0, 50.0]);
        assert_eq!(
            ratios.per_round.len(),
            3,
            "a round the peer lacks has no ratio"
        );
        assert!(
            ratios.per_round[0].is_nan() && ratios.per_round[2].is_nan(),
            "a zero or missing figure must give NaN, not infinity: {:?}",
            ratios.per_round
        );
        assert_eq!(
            (ratios.median, ratios.lowest, ratios.highest),
            (2.0, 2.0, 2.0),
            "only the one usable round should count"
        );
        let none = PairedRatios::new(&[], &[]);
        assert!(
            none.median.is_nan() && none.lowest.is_nan() && none.highest.is_nan(),
            "no rounds must not read as a ratio: {none:?}"
        );
    }

    #[test]
    fn the_spread_gives_the_range_as_a_fraction_of_the_median() {
        let spread = Spread::of(&[125.0, 170.0, 133.0]);
        assert_eq!(
            (spread.lowest, spread.median, spread.highest),
            (125.0, 133.0, 170.0),
            "lowest, median and highest of three rounds"
        );
        let range = spread.range_of_median();
        assert!(
            (range - 45.0 / 133.0).abs() < 1e-12,
            "the range 45 over the median 133 should be about 0.34, got {range}"
        );
        assert!(Spread::of(&[]).median.is_nan(), "no samples have no spread");
    }
}
