//! Tensor sets: names, dtypes, shapes and byte ranges packed back to back
//! in one source buffer, so the baselines and acp copy the same bytes.

use acp_core::{Dtype, HostTensor};

use crate::buf::Rng;

/// One tensor: a byte range of the source buffer.
#[derive(Debug, Clone)]
pub struct Tensor {
    /// Unique name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape; its element count times the dtype size is `len`.
    pub shape: Vec<u64>,
    /// Offset in the source buffer.
    pub offset: usize,
    /// Byte length.
    pub len: usize,
}

/// A list of tensors packed from offset 0 with no gaps; `total` bytes.
#[derive(Debug, Clone, Default)]
pub struct TensorSet {
    /// The tensors, in save order.
    pub tensors: Vec<Tensor>,
    /// Their total size in bytes.
    pub total: usize,
}

impl TensorSet {
    fn push(&mut self, name: String, dtype: Dtype, elem: usize, shape: Vec<u64>) {
        let numel: u64 = shape.iter().product();
        let len = usize::try_from(numel).expect("bench tensors fit in memory") * elem;
        self.tensors.push(Tensor {
            name,
            dtype,
            shape,
            offset: self.total,
            len,
        });
        self.total += len;
    }

    /// A model-like state of exactly `total` bytes: a 0-d `I64` step
    /// counter, then transformer blocks (F32 weights of hidden size 512, or
    /// 1024 from 1 GiB up, with two Adam moments each, plus 1-d norms), then
    /// one tensor holding whatever bytes remain: `F32` when they are whole
    /// fp32 values, else `U8`.
    ///
    /// # Panics
    /// Never on a 64-bit target (block sizes fit `usize`).
    #[must_use]
    pub fn model_like(total: usize) -> TensorSet {
        let d: u64 = if total >= 1 << 30 { 1024 } else { 512 };
        let mut set = TensorSet::default();
        set.push("step".into(), Dtype::I64, 8, vec![]);
        let mats: [(&str, u64, u64); 4] = [
            ("attn.qkv", 3 * d, d),
            ("attn.out", d, d),
            ("mlp.up", 4 * d, d),
            ("mlp.down", d, 4 * d),
        ];
        let vecs = ["ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias"];
        let block_bytes = usize::try_from((12 * d * d + 4 * d) * 4 * 3).expect("small");
        let mut layer = 0;
        while set.total + block_bytes <= total {
            for part in ["param", "exp_avg", "exp_avg_sq"] {
                for (m, rows, cols) in mats {
                    set.push(
                        format!("{part}.layers.{layer}.{m}.weight"),
                        Dtype::F32,
                        4,
                        vec![rows, cols],
                    );
                }
                for v in vecs {
                    set.push(format!("{part}.layers.{layer}.{v}"), Dtype::F32, 4, vec![d]);
                }
            }
            layer += 1;
        }
        let rest = total.saturating_sub(set.total);
        if rest > 0 {
            // Typed by what fills it: the benches fill a state with fp32
            // values (or random bytes), and a compressed file groups a
            // tensor's bytes by its dtype's width, so 26 MB of fp32 values
            // typed `U8` in the 64 MiB state compressed as one plane of
            // interleaved float bytes, which no training state holds.
            if rest % 4 == 0 {
                set.push("misc".into(), Dtype::F32, 4, vec![rest as u64 / 4]);
            } else {
                set.push("misc".into(), Dtype::U8, 1, vec![rest as u64]);
            }
        }
        set
    }

    /// `n` F32 tensors of random sizes between `min` and `max` bytes
    /// (multiples of 4), from a fixed `seed`.
    #[must_use]
    pub fn small(n: usize, min: usize, max: usize, seed: u64) -> TensorSet {
        let mut rng = Rng::new(seed);
        let mut set = TensorSet::default();
        for i in 0..n {
            let bytes = rng.range(min as u64, max as u64) / 4 * 4;
            set.push(format!("t.{i:06}"), Dtype::F32, 4, vec![bytes / 4]);
        }
        set
    }

    /// `n` `U8` tensors that together hold exactly `total` bytes.
    #[must_use]
    pub fn even(n: usize, total: usize) -> TensorSet {
        let mut set = TensorSet::default();
        let n = n.max(1);
        for i in 0..n {
            let len = total / n + usize::from(i < total % n);
            set.push(format!("big.{i:02}"), Dtype::U8, 1, vec![len as u64]);
        }
        set
    }

    /// The number of tensors.
    #[must_use]
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether there are none.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Each tensor's `(index, offset, len)` in a buffer of `total` bytes,
    /// as [`split_dst`](crate::split_dst) takes them.
    #[must_use]
    pub fn ranges(&self) -> Vec<(usize, usize, usize)> {
        self.tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (i, t.offset, t.len))
            .collect()
    }

    /// The tensors as [`HostTensor`]s over `src` (at least `total` bytes).
    #[must_use]
    pub fn host<'a>(&'a self, src: &'a [u8]) -> Vec<HostTensor<'a>> {
        self.tensors
            .iter()
            .map(|t| HostTensor {
                name: &t.name,
                dtype: t.dtype,
                shape: &t.shape,
                data: &src[t.offset..t.offset + t.len],
            })
            .collect()
    }

    /// (destination, source) pairs at the same offsets of `dst` and `src`.
    #[must_use]
    pub fn pairs<'a>(&self, dst: &'a mut [u8], src: &'a [u8]) -> Vec<(&'a mut [u8], &'a [u8])> {
        let mut out = Vec::with_capacity(self.tensors.len());
        let mut rest = &mut dst[..self.total];
        for t in &self.tensors {
            let (d, tail) = std::mem::take(&mut rest).split_at_mut(t.len);
            out.push((d, &src[t.offset..t.offset + t.len]));
            rest = tail;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_are_packed_and_exact() {
        for total in [1 << 20, 100 << 20, (256 << 20) + 4096] {
            let s = TensorSet::model_like(total);
            assert_eq!(s.total, total);
            assert_eq!(s.tensors.iter().map(|t| t.len).sum::<usize>(), total);
        }
        let s = TensorSet::small(1000, 4 << 10, 64 << 10, 1);
        assert!(s
            .tensors
            .iter()
            .all(|t| (4 << 10) - 4 <= t.len && t.len <= 64 << 10));
        assert_eq!(TensorSet::small(1000, 4 << 10, 64 << 10, 1).total, s.total);
        let e = TensorSet::even(10, s.total);
        assert_eq!((e.len(), e.total), (10, s.total));
    }
}
