//! f32 vector helpers of attention (a dot product and a scaled add) with an AVX2 path that gives the same bits
//! as the portable one.
//!
//! Attention's score and value loops are most of a long prompt's prefill (57% of a 2,048-token SmolLM2 prefill
//! in a profile). Compiled for the baseline x86-64 target they run on 128-bit registers; the AVX2 versions here
//! do the same operations in the same order on 256-bit ones: multiplies and adds kept apart (no FMA, which
//! rounds once where the portable code rounds twice), the dot product's eight running sums in one register
//! and reduced in the portable code's order. So a row's result does not depend on the CPU's level. The `_heads`
//! forms serve the query heads that share a key and value head (grouped-query attention: 3 per key head in
//! SmolLM2, 4 in gemma-3) at once, widening each f16 cache row once for all of them; each head gets the bits the
//! one-head form gives it. A 950-token prefill took 0.89x (SmolLM2) and 0.87x (gemma-3) of its time with them.

/// The dot product of two equal-length rows in a fixed order: eight running sums over chunks of eight, summed
/// as `((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7))`, plus the tail summed in order.
pub fn dot(left: &[f32], right: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2 (checked by `avx2()`).
        return unsafe { x86::dot(left, right) };
    }
    dot_portable(left, right)
}

/// `out[i] += weight * values[i]` for every `i` of the shorter of the two, each a multiply then an add.
pub fn add_scaled(out: &mut [f32], weight: f32, values: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2 (checked by `avx2()`).
        return unsafe { x86::add_scaled(out, weight, values) };
    }
    add_scaled_portable(out, weight, values);
}

/// `out[k] = dot(query, keys[k])` for each row `k` of `keys` (rows of `query.len()` values): one CPU check for
/// all of them.
pub fn dots(query: &[f32], keys: &[f32], out: &mut [f32]) {
    let width = query.len().max(1);
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        if width.is_multiple_of(8) {
            // SAFETY: the CPU has AVX2 (checked by `avx2()`); the width is whole chunks of eight.
            return unsafe { x86::dots(query, keys, out) };
        }
        for (score, key) in out.iter_mut().zip(keys.chunks_exact(width)) {
            // SAFETY: the CPU has AVX2 (checked by `avx2()`).
            *score = unsafe { x86::dot(query, key) };
        }
        return;
    }
    for (score, key) in out.iter_mut().zip(keys.chunks_exact(width)) {
        *score = dot_portable(query, key);
    }
}

/// `out = Σ_k weights[k] · values[k]` over the rows of `values` (rows of `out.len()` values) in order, from
/// zero: [`add_scaled`] row after row, with one CPU check for all of them.
pub fn weighted_sum(out: &mut [f32], weights: &[f32], values: &[f32]) {
    out.fill(0.0);
    let width = out.len().max(1);
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        if width.is_multiple_of(8) {
            // SAFETY: the CPU has AVX2 (checked by `avx2()`); the width is whole chunks of eight.
            return unsafe { x86::weighted_sum(out, weights, values) };
        }
        for (&weight, value) in weights.iter().zip(values.chunks_exact(width)) {
            // SAFETY: the CPU has AVX2 (checked by `avx2()`).
            unsafe { x86::add_scaled(out, weight, value) };
        }
        return;
    }
    for (&weight, value) in weights.iter().zip(values.chunks_exact(width)) {
        add_scaled_portable(out, weight, value);
    }
}

/// [`dots`] over keys stored as f16 bits (an attention cache): each key row is widened to f32 exactly, so the
/// scores are the bits [`dots`] gives on the widened rows.
pub fn dots_f16(query: &[f32], keys: &[u16], out: &mut [f32]) {
    let width = query.len().max(1);
    #[cfg(target_arch = "x86_64")]
    if avx2_f16c() && width.is_multiple_of(8) {
        // SAFETY: the CPU has AVX2 and F16C (checked above); the width is whole chunks of eight.
        return unsafe { x86::dots_f16(query, keys, out) };
    }
    let mut row = vec![0f32; width];
    for (score, key) in out.iter_mut().zip(keys.chunks_exact(width)) {
        widen(key, &mut row);
        *score = dot(query, &row);
    }
}

/// [`weighted_sum`] over value rows stored as f16 bits: the bits [`weighted_sum`] gives on the widened rows.
pub fn weighted_sum_f16(out: &mut [f32], weights: &[f32], values: &[u16]) {
    let width = out.len().max(1);
    #[cfg(target_arch = "x86_64")]
    if avx2_f16c() && width.is_multiple_of(8) {
        // SAFETY: the CPU has AVX2 and F16C (checked above); the width is whole chunks of eight.
        return unsafe { x86::weighted_sum_f16(out, weights, values) };
    }
    out.fill(0.0);
    let mut row = vec![0f32; width];
    for (&weight, value) in weights.iter().zip(values.chunks_exact(width)) {
        widen(value, &mut row);
        add_scaled(out, weight, &row);
    }
}

/// [`dots_f16`] for the query heads that share one key head: `queries` holds `heads` query rows of `width` values
/// (`heads = queries.len() / width`), `out` as many rows of scores, one per key row of `keys` it has room for. Each
/// score has the bits [`dots_f16`] gives that query alone; the AVX2 code widens each key once for all the heads
/// (grouped-query attention reads a key head once per query head otherwise).
pub fn dots_f16_heads(queries: &[f32], width: usize, keys: &[u16], out: &mut [f32]) {
    let heads = queries.len() / width.max(1);
    let count = out.len() / heads.max(1);
    if heads == 0 || count == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if avx2_f16c() && width.is_multiple_of(8) && width > 0 {
        type Grouped = unsafe fn(&[f32], usize, &[u16], &mut [f32], usize);
        let grouped: Option<Grouped> = match heads {
            1 => Some(x86::dots_f16_heads::<1>),
            2 => Some(x86::dots_f16_heads::<2>),
            3 => Some(x86::dots_f16_heads::<3>),
            4 => Some(x86::dots_f16_heads::<4>),
            _ => None,
        };
        if let Some(grouped) = grouped {
            // SAFETY: the CPU has AVX2 and F16C (checked above); the width is whole chunks of eight; `queries`
            // holds `heads` rows and `out` `heads` rows of `count`.
            return unsafe { grouped(queries, width, keys, out, count) };
        }
    }
    for (query, scores) in queries.chunks_exact(width).zip(out.chunks_exact_mut(count)) {
        dots_f16(query, keys, scores);
    }
}

/// [`weighted_sum_f16`] for the query heads that share one value head: `weights` holds `heads` rows of weights
/// (`heads = out.len() / width`), one per value row, and `out` as many rows of `width` sums. Each row has the bits
/// [`weighted_sum_f16`] gives that head alone; the AVX2 code widens each value once for all the heads.
pub fn weighted_sum_f16_heads(out: &mut [f32], width: usize, weights: &[f32], values: &[u16]) {
    let heads = out.len() / width.max(1);
    if heads == 0 {
        return;
    }
    let count = weights.len() / heads;
    if count == 0 {
        // A sum of no rows.
        out.fill(0.0);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if avx2_f16c() && width.is_multiple_of(8) && width > 0 {
        type Grouped = unsafe fn(&mut [f32], usize, &[f32], usize, &[u16]);
        let grouped: Option<Grouped> = match heads {
            1 => Some(x86::weighted_sum_f16_heads::<1>),
            2 => Some(x86::weighted_sum_f16_heads::<2>),
            3 => Some(x86::weighted_sum_f16_heads::<3>),
            4 => Some(x86::weighted_sum_f16_heads::<4>),
            _ => None,
        };
        if let Some(grouped) = grouped {
            // SAFETY: the CPU has AVX2 and F16C (checked above); the width is whole chunks of eight; `out`
            // holds `heads` rows and `weights` `heads` rows of `count`.
            return unsafe { grouped(out, width, weights, count, values) };
        }
    }
    for (sums, head_weights) in out.chunks_exact_mut(width).zip(weights.chunks_exact(count)) {
        weighted_sum_f16(sums, head_weights, values);
    }
}

/// f16 bits to f32, exactly.
fn widen(bits: &[u16], out: &mut [f32]) {
    for (wide, &narrow) in out.iter_mut().zip(bits) {
        *wide = half::f16::from_bits(narrow).to_f32();
    }
}

/// [`dot`] without intrinsics.
pub fn dot_portable(left: &[f32], right: &[f32]) -> f32 {
    let length = left.len().min(right.len());
    let (left, right) = (&left[..length], &right[..length]);
    let mut lanes = [0f32; 8];
    let left_chunks = left.chunks_exact(8);
    let right_chunks = right.chunks_exact(8);
    let tail: f32 = left_chunks
        .remainder()
        .iter()
        .zip(right_chunks.remainder())
        .map(|(a, b)| a * b)
        .sum();
    for (a, b) in left_chunks.zip(right_chunks) {
        for lane in 0..8 {
            lanes[lane] += a[lane] * b[lane];
        }
    }
    let quads = [
        lanes[0] + lanes[4],
        lanes[1] + lanes[5],
        lanes[2] + lanes[6],
        lanes[3] + lanes[7],
    ];
    (quads[0] + quads[2]) + (quads[1] + quads[3]) + tail
}

/// [`add_scaled`] without intrinsics.
pub fn add_scaled_portable(out: &mut [f32], weight: f32, values: &[f32]) {
    for (accumulated, &value) in out.iter_mut().zip(values) {
        *accumulated += weight * value;
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    std::is_x86_feature_detected!("avx2")
}

#[cfg(target_arch = "x86_64")]
fn avx2_f16c() -> bool {
    avx2() && std::is_x86_feature_detected!("f16c")
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The AVX2 bodies.
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) unsafe fn dot(left: &[f32], right: &[f32]) -> f32 {
        let length = left.len().min(right.len());
        let chunks = length / 8;
        let mut lanes = _mm256_setzero_ps();
        for chunk in 0..chunks {
            // SAFETY: chunk * 8 + 8 <= length <= both lengths; unaligned loads.
            let (a, b) = unsafe {
                (
                    _mm256_loadu_ps(left.as_ptr().add(chunk * 8)),
                    _mm256_loadu_ps(right.as_ptr().add(chunk * 8)),
                )
            };
            lanes = _mm256_add_ps(lanes, _mm256_mul_ps(a, b));
        }
        let tail: f32 = left[chunks * 8..length]
            .iter()
            .zip(&right[chunks * 8..length])
            .map(|(a, b)| a * b)
            .sum();
        // [s0+s4, s1+s5, s2+s6, s3+s7], then [q0+q2, q1+q3], then their sum: the portable order.
        let quads = _mm_add_ps(
            _mm256_castps256_ps128(lanes),
            _mm256_extractf128_ps(lanes, 1),
        );
        let pairs = _mm_add_ps(quads, _mm_movehl_ps(quads, quads));
        let sum = _mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 0b01));
        _mm_cvtss_f32(sum) + tail
    }

    /// Generates the attention loops for rows stored as `$element` (`$load` reads eight of them as f32, exactly):
    /// `$dots` ([`super::dots`] for a width of whole chunks of eight, four keys at a time: each key keeps its own
    /// running sums and reduction order, so the bits of [`dot`], and the four independent chains of adds overlap
    /// where one key's chain would wait on each add's latency) and `$weighted_sum` ([`super::weighted_sum`]: 64
    /// output values at a time stay in registers over every row, each still summing its products in row order, a
    /// multiply then an add, so the bits of [`add_scaled`] row after row, instead of a load and a store per row).
    macro_rules! attention_loops {
        ($dots:ident, $weighted_sum:ident, $element:ty, $features:literal, $load:expr) => {
            /// # Safety
            /// The CPU must support the features named; `query.len()` must be a multiple of 8.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $dots(query: &[f32], keys: &[$element], out: &mut [f32]) {
                let width = query.len();
                debug_assert!(width.is_multiple_of(8) && width > 0);
                let count = out.len().min(keys.len() / width);
                let chunks = width / 8;
                // SAFETY (callers): key < count and chunk * 8 + 8 <= width, so the 8 values are in `keys`.
                let load = |key: usize, chunk: usize| unsafe {
                    $load(keys.as_ptr().add(key * width + chunk * 8))
                };
                let mut key = 0;
                while key + 4 <= count {
                    let mut lanes = [_mm256_setzero_ps(); 4];
                    for chunk in 0..chunks {
                        // SAFETY: chunk * 8 + 8 <= width = query.len().
                        let q = unsafe { _mm256_loadu_ps(query.as_ptr().add(chunk * 8)) };
                        for (lane, sums) in lanes.iter_mut().enumerate() {
                            *sums = _mm256_add_ps(*sums, _mm256_mul_ps(q, load(key + lane, chunk)));
                        }
                    }
                    for (lane, sums) in lanes.iter().enumerate() {
                        out[key + lane] = reduce(*sums);
                    }
                    key += 4;
                }
                while key < count {
                    let mut sums = _mm256_setzero_ps();
                    for chunk in 0..chunks {
                        // SAFETY: chunk * 8 + 8 <= width = query.len().
                        let q = unsafe { _mm256_loadu_ps(query.as_ptr().add(chunk * 8)) };
                        sums = _mm256_add_ps(sums, _mm256_mul_ps(q, load(key, chunk)));
                    }
                    out[key] = reduce(sums);
                    key += 1;
                }
            }

            /// # Safety
            /// The CPU must support the features named; `out.len()` must be a multiple of 8.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $weighted_sum(
                out: &mut [f32],
                weights: &[f32],
                values: &[$element],
            ) {
                let width = out.len();
                debug_assert!(width.is_multiple_of(8) && width > 0);
                let rows = weights.len().min(values.len() / width);
                let mut start = 0;
                while start < width {
                    let chunks = ((width - start) / 8).min(8);
                    let mut sums = [_mm256_setzero_ps(); 8];
                    for (row, &weight) in weights[..rows].iter().enumerate() {
                        let scale = _mm256_set1_ps(weight);
                        for (chunk, sum) in sums[..chunks].iter_mut().enumerate() {
                            // SAFETY: start + chunk * 8 + 8 <= width; values hold `rows` rows of `width`.
                            let value = unsafe {
                                $load(values.as_ptr().add(row * width + start + chunk * 8))
                            };
                            *sum = _mm256_add_ps(*sum, _mm256_mul_ps(scale, value));
                        }
                    }
                    for (chunk, sum) in sums[..chunks].iter().enumerate() {
                        // SAFETY: start + chunk * 8 + 8 <= width = out.len().
                        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(start + chunk * 8), *sum) };
                    }
                    start += chunks * 8;
                }
            }
        };
    }

    attention_loops!(dots, weighted_sum, f32, "avx2", |at: *const f32| {
        _mm256_loadu_ps(at)
    });
    // f16 rows (the attention cache) are widened in registers (`vcvtph2ps`, exact).
    attention_loops!(
        dots_f16,
        weighted_sum_f16,
        u16,
        "avx2,f16c",
        |at: *const u16| { _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i)) }
    );

    /// The eight f32 values of `at` (eight f16 bits), exactly.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C, and `at` must point at eight readable values.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn widen_eight(at: *const u16) -> __m256 {
        // SAFETY: the contract's 16 bytes are readable; an unaligned load.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(at as *const __m128i) })
    }

    /// `dots_f16` for `HEADS` queries (rows of `width` in `queries`) against the first `count` rows of `keys`,
    /// scores into `out` (`HEADS` rows of `count`): each key chunk widened once, then each head's eight running
    /// sums advanced by a multiply and an add, as `dots` does for one.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C; `width` must be a positive multiple of 8, `queries` hold `HEADS * width`
    /// values and `out` `HEADS * count`.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn dots_f16_heads<const HEADS: usize>(
        queries: &[f32],
        width: usize,
        keys: &[u16],
        out: &mut [f32],
        count: usize,
    ) {
        assert!(queries.len() >= HEADS * width && out.len() >= HEADS * count);
        // `count` stays each head's row of scores; only the keys there are get one.
        for key in 0..count.min(keys.len() / width) {
            let mut sums = [_mm256_setzero_ps(); HEADS];
            for chunk in 0..width / 8 {
                // SAFETY: key < count <= keys.len() / width and chunk * 8 + 8 <= width.
                let k = unsafe { widen_eight(keys.as_ptr().add(key * width + chunk * 8)) };
                for (head, sum) in sums.iter_mut().enumerate() {
                    // SAFETY: head * width + chunk * 8 + 8 <= HEADS * width <= queries.len() (asserted).
                    let q =
                        unsafe { _mm256_loadu_ps(queries.as_ptr().add(head * width + chunk * 8)) };
                    *sum = _mm256_add_ps(*sum, _mm256_mul_ps(q, k));
                }
            }
            for (head, sum) in sums.iter().enumerate() {
                out[head * count + key] = reduce(*sum);
            }
        }
    }

    /// `weighted_sum_f16` for `HEADS` rows of `count` weights over the same value rows, sums into `out` (`HEADS`
    /// rows of `width`): a few chunks of each value row widened once and added, weighted, into every head's sums,
    /// as `weighted_sum` does for one (from zero, rows in order, a multiply then an add).
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C; `width` must be a positive multiple of 8, `out` hold `HEADS * width`
    /// values and `weights` `HEADS * count`.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn weighted_sum_f16_heads<const HEADS: usize>(
        out: &mut [f32],
        width: usize,
        weights: &[f32],
        count: usize,
        values: &[u16],
    ) {
        assert!(out.len() >= HEADS * width && weights.len() >= HEADS * count);
        let rows = count.min(values.len() / width);
        // Passes over the rows, each for a few chunks of every head's sums, all in registers: four chunks of up
        // to three heads (12 of the 16), two of four heads; then what the width leaves, two and one at a time.
        let mut start = 0;
        while start < width {
            let left = (width - start) / 8;
            // SAFETY (each arm): the pass's chunks are inside the width (`left` of them remain); the rest of its
            // contract is this function's.
            start += unsafe {
                if HEADS <= 3 && left >= 4 {
                    weighted_pass::<HEADS, 4>(out, width, weights, count, values, rows, start)
                } else if left >= 2 {
                    weighted_pass::<HEADS, 2>(out, width, weights, count, values, rows, start)
                } else {
                    weighted_pass::<HEADS, 1>(out, width, weights, count, values, rows, start)
                }
            };
        }
    }

    /// One pass of `weighted_sum_f16_heads` over the first `rows` value rows for the `CHUNKS` chunks of eight
    /// from `start`; returns how many values it covered.
    ///
    /// # Safety
    /// As `weighted_sum_f16_heads`, and `start + 8 * CHUNKS <= width`, `rows <= values.len() / width`,
    /// `rows <= count`.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn weighted_pass<const HEADS: usize, const CHUNKS: usize>(
        out: &mut [f32],
        width: usize,
        weights: &[f32],
        count: usize,
        values: &[u16],
        rows: usize,
        start: usize,
    ) -> usize {
        let mut sums = [[_mm256_setzero_ps(); CHUNKS]; HEADS];
        for row in 0..rows {
            // SAFETY: row < rows <= values.len() / width and start + chunk * 8 + 8 <= width (contract).
            let lines: [__m256; CHUNKS] = std::array::from_fn(|chunk| unsafe {
                widen_eight(values.as_ptr().add(row * width + start + chunk * 8))
            });
            for (head, head_sums) in sums.iter_mut().enumerate() {
                let scale = _mm256_set1_ps(weights[head * count + row]);
                for (sum, line) in head_sums.iter_mut().zip(&lines) {
                    *sum = _mm256_add_ps(*sum, _mm256_mul_ps(scale, *line));
                }
            }
        }
        for (head, head_sums) in sums.iter().enumerate() {
            for (chunk, sum) in head_sums.iter().enumerate() {
                // SAFETY: head * width + start + chunk * 8 + 8 <= HEADS * width <= out.len() (contract).
                unsafe {
                    _mm256_storeu_ps(out.as_mut_ptr().add(head * width + start + chunk * 8), *sum)
                };
            }
        }
        8 * CHUNKS
    }

    /// The sum of a dot product's eight running sums in the portable order.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn reduce(lanes: __m256) -> f32 {
        let quads = _mm_add_ps(
            _mm256_castps256_ps128(lanes),
            _mm256_extractf128_ps(lanes, 1),
        );
        let pairs = _mm_add_ps(quads, _mm_movehl_ps(quads, quads));
        let sum = _mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 0b01));
        _mm_cvtss_f32(sum)
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) unsafe fn add_scaled(out: &mut [f32], weight: f32, values: &[f32]) {
        let length = out.len().min(values.len());
        let chunks = length / 8;
        let scale = _mm256_set1_ps(weight);
        for chunk in 0..chunks {
            // SAFETY: chunk * 8 + 8 <= length <= both lengths; unaligned loads and store.
            unsafe {
                let at = out.as_mut_ptr().add(chunk * 8);
                let value = _mm256_loadu_ps(values.as_ptr().add(chunk * 8));
                _mm256_storeu_ps(
                    at,
                    _mm256_add_ps(_mm256_loadu_ps(at), _mm256_mul_ps(scale, value)),
                );
            }
        }
        for (accumulated, &value) in out[chunks * 8..length]
            .iter_mut()
            .zip(&values[chunks * 8..length])
        {
            *accumulated += weight * value;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn the_dispatched_helpers_give_the_portable_bits_for_every_length() {
        let mut rng = StdRng::seed_from_u64(0xA77E);
        for length in [0, 1, 7, 8, 9, 16, 31, 32, 64, 65, 128, 256] {
            for _ in 0..50 {
                let left: Vec<f32> = (0..length).map(|_| rng.random_range(-4.0..4.0)).collect();
                let right: Vec<f32> = (0..length).map(|_| rng.random_range(-4.0..4.0)).collect();
                assert_eq!(
                    dot(&left, &right).to_bits(),
                    dot_portable(&left, &right).to_bits(),
                    "dot of length {length}"
                );
                let weight = rng.random_range(-2.0..2.0);
                let mut fast = left.clone();
                let mut portable = left.clone();
                add_scaled(&mut fast, weight, &right);
                add_scaled_portable(&mut portable, weight, &right);
                let bits = |values: &[f32]| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&fast),
                    bits(&portable),
                    "add_scaled of length {length}"
                );
                if length > 0 {
                    // Seven rows of `length` values against one query (a group of four and three left over),
                    // and summed back with weights.
                    let keys: Vec<f32> = (0..7 * length)
                        .map(|_| rng.random_range(-4.0..4.0))
                        .collect();
                    let mut scores = [0f32; 7];
                    dots(&left, &keys, &mut scores);
                    for (row, score) in scores.iter().enumerate() {
                        let key = &keys[row * length..(row + 1) * length];
                        assert_eq!(score.to_bits(), dot_portable(&left, key).to_bits());
                    }
                    let mut summed = vec![0f32; length];
                    weighted_sum(&mut summed, &scores, &keys);
                    let mut expected = vec![0f32; length];
                    for (row, &weight) in scores.iter().enumerate() {
                        add_scaled_portable(
                            &mut expected,
                            weight,
                            &keys[row * length..(row + 1) * length],
                        );
                    }
                    assert_eq!(
                        bits(&summed),
                        bits(&expected),
                        "weighted_sum of length {length}"
                    );
                    // The same rows stored as f16 bits give the bits of the f32 helpers on the widened rows.
                    let narrow: Vec<u16> = keys
                        .iter()
                        .map(|&value| half::f16::from_f32(value).to_bits())
                        .collect();
                    let widened: Vec<f32> = narrow
                        .iter()
                        .map(|&value| half::f16::from_bits(value).to_f32())
                        .collect();
                    let mut narrow_scores = [0f32; 7];
                    dots_f16(&left, &narrow, &mut narrow_scores);
                    let mut wide_scores = [0f32; 7];
                    dots(&left, &widened, &mut wide_scores);
                    assert_eq!(
                        bits(&narrow_scores),
                        bits(&wide_scores),
                        "dots_f16 of length {length}"
                    );
                    let mut narrow_summed = vec![0f32; length];
                    weighted_sum_f16(&mut narrow_summed, &scores, &narrow);
                    let mut wide_summed = vec![0f32; length];
                    weighted_sum(&mut wide_summed, &scores, &widened);
                    assert_eq!(
                        bits(&narrow_summed),
                        bits(&wide_summed),
                        "weighted_sum_f16 of length {length}"
                    );
                    // Several query heads sharing the keys (1 to 6: the grouped AVX2 code takes 1 to 4, the rest
                    // go head by head) give each head's own bits.
                    for heads in 1..=6 {
                        let queries: Vec<f32> = (0..heads * length)
                            .map(|_| rng.random_range(-4.0..4.0))
                            .collect();
                        let mut grouped = vec![0f32; heads * 7];
                        dots_f16_heads(&queries, length, &narrow, &mut grouped);
                        let weights: Vec<f32> = (0..heads * 7)
                            .map(|_| rng.random_range(-2.0..2.0))
                            .collect();
                        let mut grouped_sums = vec![0f32; heads * length];
                        weighted_sum_f16_heads(&mut grouped_sums, length, &weights, &narrow);
                        for head in 0..heads {
                            let mut alone = [0f32; 7];
                            dots_f16(&queries[head * length..][..length], &narrow, &mut alone);
                            assert_eq!(
                                bits(&grouped[head * 7..][..7]),
                                bits(&alone),
                                "dots_f16_heads of length {length}, head {head} of {heads}"
                            );
                            let mut summed_alone = vec![0f32; length];
                            weighted_sum_f16(&mut summed_alone, &weights[head * 7..][..7], &narrow);
                            assert_eq!(
                                bits(&grouped_sums[head * length..][..length]),
                                bits(&summed_alone),
                                "weighted_sum_f16_heads of length {length}, head {head} of {heads}"
                            );
                        }
                    }
                }
            }
        }
    }
}
