//! Dense f32 tensors of the CPU backend and the matrix product they use.

use ndarray::linalg::general_mat_mul;
use ndarray::{ArrayView2, ArrayViewMut2};
use serde::{Deserialize, Serialize};

/// A dense row-major f32 tensor (integer inputs such as token ids are stored exactly as f32).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Tensor {
    /// Extent of every axis.
    pub shape: Vec<usize>,
    /// Elements in row-major order.
    pub data: Vec<f32>,
}

impl Tensor {
    /// A tensor of zeros.
    pub fn zeros(shape: Vec<usize>) -> Tensor {
        let n = shape.iter().product();
        Tensor {
            shape,
            data: vec![0.0; n],
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Length of the last axis (1 for a scalar).
    pub fn last(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// `self += other`, element by element.
    pub fn add_assign(&mut self, other: &Tensor) {
        for (a, b) in self.data.iter_mut().zip(&other.data) {
            *a += b;
        }
    }
}

/// A matrix operand: `rows x cols` as used in the product, stored transposed when `transposed`.
#[derive(Clone, Copy)]
pub struct Mat<'a> {
    /// Elements.
    pub data: &'a [f32],
    /// Rows as used.
    pub rows: usize,
    /// Columns as used.
    pub cols: usize,
    /// Stored as `cols x rows`.
    pub transposed: bool,
}

impl<'a> Mat<'a> {
    /// A row-major `rows x cols` matrix.
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Mat {
            data,
            rows,
            cols,
            transposed: false,
        }
    }

    /// The transpose of a row-major `stored_rows x stored_cols` matrix.
    pub fn t(data: &'a [f32], stored_rows: usize, stored_cols: usize) -> Self {
        Mat {
            data,
            rows: stored_cols,
            cols: stored_rows,
            transposed: true,
        }
    }

    fn view(&self) -> ArrayView2<'a, f32> {
        let shape = if self.transposed {
            (self.cols, self.rows)
        } else {
            (self.rows, self.cols)
        };
        // Shapes are derived from the same buffers by the kernels; a mismatch is a bug.
        let v = ArrayView2::from_shape(shape, self.data)
            .unwrap_or_else(|_| panic!("matrix {shape:?} over {} elements", self.data.len()));
        if self.transposed {
            v.reversed_axes()
        } else {
            v
        }
    }
}

/// `out = a · b` (or `out += a · b` when `accumulate`), `out` row-major `a.rows x b.cols`.
pub fn matmul(a: Mat<'_>, b: Mat<'_>, out: &mut [f32], accumulate: bool) {
    debug_assert_eq!(a.cols, b.rows);
    let mut c = ArrayViewMut2::from_shape((a.rows, b.cols), out)
        .unwrap_or_else(|_| panic!("output {} x {}", a.rows, b.cols));
    let beta = if accumulate { 1.0 } else { 0.0 };
    general_mat_mul(1.0, &a.view(), &b.view(), beta, &mut c);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_with_transposes() {
        // a = [[1, 2, 3], [4, 5, 6]], b = [[1, 0], [0, 1], [1, 1]].
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
        let mut out = [0.0; 4];
        matmul(Mat::new(&a, 2, 3), Mat::new(&b, 3, 2), &mut out, false);
        assert_eq!(out, [4.0, 5.0, 10.0, 11.0]);
        // aᵀ stored: aᵀ·aᵀᵀ = a·aᵀ read through transposed operands.
        let mut g = [0.0; 4];
        matmul(Mat::new(&a, 2, 3), Mat::t(&a, 2, 3), &mut g, false);
        assert_eq!(g, [14.0, 32.0, 32.0, 77.0]);
        matmul(Mat::new(&a, 2, 3), Mat::t(&a, 2, 3), &mut g, true);
        assert_eq!(g, [28.0, 64.0, 64.0, 154.0]);
    }
}
