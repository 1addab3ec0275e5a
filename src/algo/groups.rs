//! The layout of a rollout batch: `P` prompts, each with `k` completions.
//! Sample `i` belongs to prompt `i / k` by construction of [`Grouped`], never
//! by comparing tokens or by reshaping a flat batch elsewhere.

/// Values laid out `[prompts][k]`: the k completions of prompt p are
/// `data[p * k .. (p + 1) * k]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Grouped<T> {
    k: usize,
    data: Vec<T>,
}

impl<T> Grouped<T> {
    /// Panics unless `data.len()` is a multiple of `k` and `k >= 1`: the
    /// layout is built by the trainer, not read from user input.
    pub fn new(k: usize, data: Vec<T>) -> Self {
        assert!(k >= 1 && data.len().is_multiple_of(k), "{} samples do not split into groups of {k}", data.len());
        Self { k, data }
    }

    pub fn k(&self) -> usize {
        self.k
    }

    pub fn num_prompts(&self) -> usize {
        self.data.len() / self.k
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn group(&self, prompt: usize) -> &[T] {
        &self.data[prompt * self.k..(prompt + 1) * self.k]
    }

    pub fn groups(&self) -> impl Iterator<Item = &[T]> {
        self.data.chunks(self.k)
    }

    pub fn flat(&self) -> &[T] {
        &self.data
    }

    pub fn into_flat(self) -> Vec<T> {
        self.data
    }

    pub fn map<U>(&self, f: impl FnMut(&T) -> U) -> Grouped<U> {
        Grouped { k: self.k, data: self.data.iter().map(f).collect() }
    }
}
