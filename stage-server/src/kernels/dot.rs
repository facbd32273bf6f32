//! Dot products of one f32 row with many rows (attention scores), in a fixed order of operations.

/// Writes `output[r] = left · rows[r * width .. (r + 1) * width]` for every row, `width = left.len()`.
///
/// Order of operations, for every row and at every SIMD level: eight running lanes over the whole chunks of
/// eight values (`lane[i] += a[i] * b[i]`, no fused multiply-add), then `((l0 + l4) + (l2 + l6)) + ((l1 + l5) +
/// (l3 + l7))`, then plus the remainder's products summed in order. A score therefore never depends on which
/// other rows it was computed with, nor on the CPU's vector width. Four rows are walked together so that four
/// independent add chains hide the latency that one chain per row waits on; that changes no result.
///
/// Panics if `rows.len() != output.len() * left.len()`.
pub fn dot_rows(left: &[f32], rows: &[f32], output: &mut [f32]) {
    assert_eq!(
        rows.len(),
        output.len() * left.len(),
        "dot_rows needs one output per row of left.len() values"
    );
    #[cfg(target_arch = "x86_64")]
    if super::x86::avx2_available() {
        // SAFETY: the CPU has AVX2 (checked just above), the only requirement of `dot_rows_avx2`.
        unsafe { dot_rows_avx2(left, rows, output) };
        return;
    }
    dot_rows_portable(left, rows, output);
}

/// [`dot_rows`] compiled with AVX2 (the eight lanes become one register).
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_rows_avx2(left: &[f32], rows: &[f32], output: &mut [f32]) {
    dot_rows_portable(left, rows, output);
}

#[inline(always)]
fn dot_rows_portable(left: &[f32], rows: &[f32], output: &mut [f32]) {
    let width = left.len();
    if width == 0 {
        output.fill(0.0);
        return;
    }
    let whole = width / 8 * 8;
    let mut row_groups = rows.chunks_exact(4 * width);
    let mut output_groups = output.chunks_exact_mut(4);
    for (group, results) in (&mut row_groups).zip(&mut output_groups) {
        let mut lanes = [[0f32; 8]; 4];
        let mut start = 0;
        while start < whole {
            let a = &left[start..start + 8];
            for (row, row_lanes) in lanes.iter_mut().enumerate() {
                let b = &group[row * width + start..row * width + start + 8];
                for lane in 0..8 {
                    row_lanes[lane] += a[lane] * b[lane];
                }
            }
            start += 8;
        }
        for (row, result) in results.iter_mut().enumerate() {
            let tail = tail_sum(
                &left[whole..],
                &group[row * width + whole..(row + 1) * width],
            );
            *result = finish(&lanes[row], tail);
        }
    }
    for (row, result) in row_groups
        .remainder()
        .chunks_exact(width)
        .zip(output_groups.into_remainder())
    {
        let mut lanes = [0f32; 8];
        let mut start = 0;
        while start < whole {
            for lane in 0..8 {
                lanes[lane] += left[start + lane] * row[start + lane];
            }
            start += 8;
        }
        *result = finish(&lanes, tail_sum(&left[whole..], &row[whole..]));
    }
}

/// The products of the values after the last whole chunk of eight, summed in order.
#[inline(always)]
fn tail_sum(left: &[f32], right: &[f32]) -> f32 {
    left.iter().zip(right).map(|(a, b)| a * b).sum()
}

/// Folds the eight lanes pairwise and adds the tail.
#[inline(always)]
fn finish(lanes: &[f32; 8], tail: f32) -> f32 {
    let quads = [
        lanes[0] + lanes[4],
        lanes[1] + lanes[5],
        lanes[2] + lanes[6],
        lanes[3] + lanes[7],
    ];
    (quads[0] + quads[2]) + (quads[1] + quads[3]) + tail
}
