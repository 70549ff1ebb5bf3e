//! Fitting device numbers to measured runs (`autopar calibrate`): which numbers may move, within
//! which physical ranges, and a bounded least-squares search.
//!
//! The objective is the sum of squared log errors of the step times, so a run 10% slow and one
//! 10% fast weigh alike whatever their length. The search is coordinate descent: each number in
//! turn is set by golden-section search over its range with the others held, sweeping until a
//! sweep gains nothing. It needs no derivatives (the cost model is piecewise: maxima of compute
//! and memory time, exposed communication), and it never leaves the ranges.

use crate::cost::cluster::{DEVICE_FIELDS, Device, DeviceField};

/// A device number calibration may fit, with the range that keeps it physical.
#[derive(Clone, Copy, Debug)]
pub struct Knob {
    /// Key of the number in `workspace.toml` overrides ([`DEVICE_FIELDS`]).
    pub key: &'static str,
    /// Least value, in the key's user units.
    pub lower: f64,
    /// Greatest value, in the key's user units.
    pub upper: f64,
    /// Why the range is what it is.
    pub source: &'static str,
}

/// The numbers calibration fits, most influential first.
pub const KNOBS: [Knob; 7] = [
    Knob {
        key: "matmul_efficiency",
        lower: 0.3,
        upper: 0.87,
        source: "mamf-finder's best shape reaches 0.87 of the A100 peak, 0.80 of the H100's",
    },
    Knob {
        key: "hbm_efficiency",
        lower: 0.5,
        upper: 0.95,
        source: "STREAM copy reaches about 0.9 of HBM peak",
    },
    Knob {
        key: "attention_efficiency",
        lower: 0.2,
        upper: 0.8,
        source: "FlashAttention-2 reaches 0.73 of A100 peak forward, 0.37 of H100's",
    },
    Knob {
        key: "fused_attention_efficiency",
        lower: 0.2,
        upper: 0.8,
        source: "cuDNN's fused attention reaches 0.6 of H100 peak forward (FlashAttention-3, Fig. 5)",
    },
    Knob {
        key: "nvlink_efficiency",
        lower: 0.4,
        upper: 0.95,
        source: "nccl-tests all-reduce bus bandwidth is 0.77-0.8 of NVLink",
    },
    Knob {
        key: "internode_efficiency",
        lower: 0.3,
        upper: 0.95,
        source: "NCCL reaches about 0.9 of an adapter's line rate",
    },
    Knob {
        key: "kernel_overhead_us",
        lower: 1.0,
        upper: 30.0,
        source: "a kernel launch and its gap take a few microseconds in eager PyTorch",
    },
];

impl Knob {
    /// The greatest value on the device preset `device`: mamf-finder's bound is lower on
    /// Hopper (0.80) than on Ampere (0.87).
    pub fn upper_on(&self, device: &str) -> f64 {
        match (self.key, device) {
            ("matmul_efficiency", "h100-sxm" | "h200") => 0.80,
            _ => self.upper,
        }
    }

    /// The device field the knob sets.
    pub fn field(&self) -> Option<&'static DeviceField> {
        DEVICE_FIELDS.iter().find(|f| f.key == self.key)
    }

    /// The knob's value on `device`, in user units.
    pub fn get(&self, device: &Device) -> f64 {
        self.field().map_or(f64::NAN, |f| {
            let mut d = device.clone();
            *(f.field)(&mut d) / f.scale
        })
    }

    /// `device` with the knob set to `value` (user units).
    pub fn set(&self, device: &mut Device, value: f64) {
        if let Some(f) = self.field() {
            *(f.field)(device) = value * f.scale;
        }
    }
}

/// Golden-section iterations per coordinate: the range shrinks by 0.618 each, so 16 leave
/// 5e-4 of it (3e-4 in matmul efficiency, well inside what a fit can tell).
const GOLDEN_STEPS: usize = 16;

/// Minimises `objective` over the box `bounds` from `start` (clamped into it) by coordinate
/// descent with golden-section line searches, at most `sweeps` sweeps; coordinates where
/// `active` is false stay at their start. Returns the point and its objective. The result is
/// never worse than the start.
pub fn minimise(
    objective: &dyn Fn(&[f64]) -> f64,
    start: &[f64],
    bounds: &[(f64, f64)],
    active: &[bool],
    sweeps: usize,
) -> (Vec<f64>, f64) {
    let mut x: Vec<f64> = start
        .iter()
        .zip(bounds)
        .map(|(&v, &(lo, hi))| v.clamp(lo, hi))
        .collect();
    let mut best = objective(&x);
    let phi = (5f64.sqrt() - 1.0) / 2.0;
    for _ in 0..sweeps {
        let before = best;
        for i in (0..x.len()).filter(|&i| active[i]) {
            let (mut a, mut b) = bounds[i];
            let at = |x: &[f64], v: f64| {
                let mut y = x.to_vec();
                y[i] = v;
                objective(&y)
            };
            let mut c = b - phi * (b - a);
            let mut d = a + phi * (b - a);
            let (mut fc, mut fd) = (at(&x, c), at(&x, d));
            for _ in 0..GOLDEN_STEPS {
                if fc <= fd {
                    b = d;
                    d = c;
                    fd = fc;
                    c = b - phi * (b - a);
                    fc = at(&x, c);
                } else {
                    a = c;
                    c = d;
                    fc = fd;
                    d = a + phi * (b - a);
                    fd = at(&x, d);
                }
            }
            // The ends too: a monotone objective has its least value on the boundary.
            let candidates = [
                (c, fc),
                (d, fd),
                (bounds[i].0, at(&x, bounds[i].0)),
                (bounds[i].1, at(&x, bounds[i].1)),
            ];
            for (v, f) in candidates {
                if f < best {
                    best = f;
                    x[i] = v;
                }
            }
        }
        if before - best <= 1e-12 * before.abs().max(1e-300) {
            break;
        }
    }
    (x, best)
}

/// Sum of squared log errors of `predicted` against `measured` (both positive).
pub fn log_squares(predicted: &[f64], measured: &[f64]) -> f64 {
    predicted
        .iter()
        .zip(measured)
        .map(|(p, m)| (p.ln() - m.ln()).powi(2))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::cluster::preset;
    use proptest::prelude::*;

    #[test]
    fn every_knob_is_a_device_field_and_presets_sit_in_range() {
        for k in KNOBS {
            assert!(k.field().is_some(), "{}", k.key);
            for name in ["a100-40g", "a100-80g", "h100-sxm", "h200"] {
                let d = preset(name).expect("preset");
                let v = k.get(&d);
                assert!(
                    (k.lower..=k.upper).contains(&v),
                    "{name}.{} = {v} outside [{}, {}]",
                    k.key,
                    k.lower,
                    k.upper
                );
                let mut e = d.clone();
                k.set(&mut e, v);
                assert_eq!(e, d);
            }
        }
    }

    #[test]
    fn finds_an_interior_optimum_and_stops_at_a_bound() {
        // Times that scale as 1/x: measured at x = 0.6 for the first coordinate; the second
        // wants 2.0, above its bound of 1.0.
        let measured = [10.0 / 0.6, 3.0 / 2.0];
        let f = |x: &[f64]| log_squares(&[10.0 / x[0], 3.0 / x[1]], &measured);
        let (x, best) = minimise(
            &f,
            &[0.9, 0.5],
            &[(0.3, 0.9), (0.1, 1.0)],
            &[true, true],
            10,
        );
        assert!((x[0] - 0.6).abs() < 1e-4, "{x:?}");
        assert_eq!(x[1], 1.0);
        assert!(best < f(&[0.9, 0.5]));
        // An inactive coordinate stays put.
        let (y, _) = minimise(
            &f,
            &[0.9, 0.5],
            &[(0.3, 0.9), (0.1, 1.0)],
            &[true, false],
            10,
        );
        assert_eq!(y[1], 0.5);
    }

    proptest! {
        #[test]
        fn never_worse_than_the_start_and_never_out_of_bounds(
            target in proptest::collection::vec(0.1f64..3.0, 1..4),
            start in proptest::collection::vec(0.1f64..3.0, 4),
            lo in 0.05f64..1.0,
            width in 0.1f64..3.0,
        ) {
            let n = target.len();
            let f = |x: &[f64]| {
                x.iter().zip(&target).map(|(a, t)| (a.ln() - t.ln()).powi(2) + (a - 1.0).abs() * 0.01).sum::<f64>()
            };
            let bounds = vec![(lo, lo + width); n];
            let start = &start[..n];
            let clamped: Vec<f64> = start.iter().map(|v| v.clamp(lo, lo + width)).collect();
            let (x, best) = minimise(&f, start, &bounds, &vec![true; n], 6);
            prop_assert!(best <= f(&clamped) + 1e-12);
            prop_assert!((best - f(&x)).abs() < 1e-12);
            for v in &x {
                prop_assert!(*v >= lo && *v <= lo + width);
            }
        }
    }
}
