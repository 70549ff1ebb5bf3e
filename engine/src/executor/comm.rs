//! In-process communication between the virtual devices of the CPU backend: collectives over
//! groups of devices and tagged point-to-point messages.
//!
//! A collective is an exchange: every member deposits its buffer, the last one to arrive
//! publishes all of them, and each member reduces them in rank order, so every member computes
//! bit-identical results, as NCCL's ring algorithms do. When a device fails, every waiting
//! device is woken and fails too instead of waiting forever.

use super::ExecError;
use super::placement::{gather, slice};
use super::tensor::Tensor;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// How often a waiting device checks whether another one failed.
const POLL: Duration = Duration::from_millis(50);

/// What a point-to-point message carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Payload {
    /// An activation, forward.
    Activation,
    /// A gradient, backward.
    Gradient,
}

/// Identifies one message: its receiver, what it is, the virtual stage it feeds, the
/// micro-batch and the value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tag {
    /// Receiving device.
    pub to: usize,
    /// Activation or gradient.
    pub payload: Payload,
    /// Virtual stage of the receiver.
    pub chunk: usize,
    /// Micro-batch.
    pub microbatch: usize,
    /// Value.
    pub value: u32,
}

#[derive(Default)]
struct Slot {
    deposits: Vec<Option<Vec<f32>>>,
    published: Option<Arc<Vec<Vec<f32>>>>,
    taken: usize,
}

#[derive(Default)]
struct State {
    slots: HashMap<(Vec<usize>, u64), Slot>,
    mail: HashMap<Tag, Tensor>,
}

/// Shared by every device of a run.
#[derive(Default)]
pub struct Fabric {
    state: Mutex<State>,
    changed: Condvar,
    failed: AtomicBool,
}

impl Fabric {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock means a device panicked; its state is still consistent for ours.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks the run failed and wakes every waiting device.
    pub fn fail(&self) {
        self.failed.store(true, Ordering::SeqCst);
        self.changed.notify_all();
    }

    fn wait<'a>(&self, guard: MutexGuard<'a, State>) -> Result<MutexGuard<'a, State>, ExecError> {
        if self.failed.load(Ordering::SeqCst) {
            return Err(ExecError::Aborted);
        }
        let (g, _) = self
            .changed
            .wait_timeout(guard, POLL)
            .unwrap_or_else(|e| e.into_inner());
        Ok(g)
    }

    /// Sends `tensor` (never blocks).
    pub fn send(&self, tag: Tag, tensor: Tensor) {
        self.lock().mail.insert(tag, tensor);
        self.changed.notify_all();
    }

    /// Waits for the message `tag`.
    pub fn recv(&self, tag: Tag) -> Result<Tensor, ExecError> {
        let mut g = self.lock();
        loop {
            if let Some(t) = g.mail.remove(&tag) {
                return Ok(t);
            }
            g = self.wait(g)?;
        }
    }

    /// Every member's buffer, in group order: member `index` of `group` contributes `data` to
    /// its `seq`-th collective on that group.
    pub fn exchange(
        &self,
        group: &[usize],
        index: usize,
        seq: u64,
        data: Vec<f32>,
    ) -> Result<Arc<Vec<Vec<f32>>>, ExecError> {
        let key = (group.to_vec(), seq);
        let n = group.len();
        let mut g = self.lock();
        {
            let slot = g.slots.entry(key.clone()).or_default();
            if slot.deposits.is_empty() {
                slot.deposits = vec![None; n];
            }
            slot.deposits[index] = Some(data);
            if slot.deposits.iter().all(Option::is_some) {
                let all = slot
                    .deposits
                    .iter_mut()
                    .map(|d| d.take().unwrap_or_default())
                    .collect();
                slot.published = Some(Arc::new(all));
                self.changed.notify_all();
            }
        }
        loop {
            let slot = g.slots.get_mut(&key).ok_or(ExecError::Aborted)?;
            if let Some(all) = slot.published.clone() {
                slot.taken += 1;
                if slot.taken == n {
                    g.slots.remove(&key);
                }
                return Ok(all);
            }
            g = self.wait(g)?;
        }
    }
}

/// One device's view of the fabric: its groups' sequence numbers.
pub struct Endpoint {
    /// The shared fabric.
    pub fabric: Arc<Fabric>,
    seqs: HashMap<Vec<usize>, u64>,
}

impl Endpoint {
    /// An endpoint on `fabric`.
    pub fn new(fabric: Arc<Fabric>) -> Self {
        Endpoint {
            fabric,
            seqs: HashMap::new(),
        }
    }

    /// All members' buffers of the next collective on `group` (this device is `group[index]`).
    pub fn exchange(
        &mut self,
        group: &[usize],
        index: usize,
        data: Vec<f32>,
    ) -> Result<Arc<Vec<Vec<f32>>>, ExecError> {
        let seq = self.seqs.entry(group.to_vec()).or_insert(0);
        let s = *seq;
        *seq += 1;
        self.fabric.exchange(group, index, s, data)
    }

    /// The whole tensor from every member's piece `t`, split along `axis` as `parts` say.
    pub fn all_gather(
        &mut self,
        group: &[usize],
        index: usize,
        t: Tensor,
        axis: usize,
        parts: &[usize],
    ) -> Result<Tensor, ExecError> {
        let shape = t.shape.clone();
        let all = self.exchange(group, index, t.data)?;
        let pieces: Vec<Tensor> = all
            .iter()
            .map(|d| Tensor {
                shape: shape.clone(),
                data: d.clone(),
            })
            .collect();
        let refs: Vec<&Tensor> = pieces.iter().collect();
        Ok(gather(&refs, axis, parts))
    }

    /// All-to-all over `group`: this device's piece `t`, split along `from` (axis and the parts
    /// the group holds together), comes back split along `to` instead: from every member the
    /// slice of its piece that is this device's along `to`, assembled along `from`.
    pub fn all_to_all(
        &mut self,
        group: &[usize],
        index: usize,
        t: Tensor,
        from: (usize, &[usize]),
        to: (usize, &[usize]),
    ) -> Result<Tensor, ExecError> {
        let shape = t.shape.clone();
        let all = self.exchange(group, index, t.data)?;
        let mine: Vec<Tensor> = all
            .iter()
            .map(|d| {
                let piece = Tensor {
                    shape: shape.clone(),
                    data: d.clone(),
                };
                slice(&piece, to.0, to.1, index, group.len())
            })
            .collect();
        let refs: Vec<&Tensor> = mine.iter().collect();
        Ok(gather(&refs, from.0, from.1))
    }

    /// One step of a ring over `group`: this device's `data` goes to the next member and the
    /// previous member's comes back (ring attention's paired send and receive).
    pub fn shift(
        &mut self,
        group: &[usize],
        index: usize,
        data: Vec<f32>,
    ) -> Result<Vec<f32>, ExecError> {
        let n = group.len();
        if n == 1 {
            return Ok(data);
        }
        let all = self.exchange(group, index, data)?;
        Ok(all[(index + n - 1) % n].clone())
    }

    /// Sum over `group`, in place.
    pub fn all_reduce_sum(
        &mut self,
        group: &[usize],
        index: usize,
        data: &mut [f32],
    ) -> Result<(), ExecError> {
        self.all_reduce(group, index, data, |a, b| a + b)
    }

    /// Maximum over `group`, in place.
    pub fn all_reduce_max(
        &mut self,
        group: &[usize],
        index: usize,
        data: &mut [f32],
    ) -> Result<(), ExecError> {
        self.all_reduce(group, index, data, f32::max)
    }

    /// `combine` over the members' buffers in rank order, in place.
    fn all_reduce(
        &mut self,
        group: &[usize],
        index: usize,
        data: &mut [f32],
        combine: impl Fn(f32, f32) -> f32,
    ) -> Result<(), ExecError> {
        if group.len() == 1 {
            return Ok(());
        }
        let all = self.exchange(group, index, data.to_vec())?;
        for (i, d) in data.iter_mut().enumerate() {
            if let Some(v) = all.iter().map(|piece| piece[i]).reduce(&combine) {
                *d = v;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_member_gets_the_same_sum() {
        let fabric = Arc::new(Fabric::default());
        let group = vec![3, 5, 7];
        let results: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3)
                .map(|i| {
                    let fabric = fabric.clone();
                    let group = group.clone();
                    s.spawn(move || {
                        let mut ep = Endpoint::new(fabric);
                        let mut data = vec![i as f32, 1.0];
                        for _ in 0..3 {
                            ep.all_reduce_sum(&group, i, &mut data).expect("reduces");
                        }
                        data
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("joins"))
                .collect()
        });
        // Three rounds of summing over three members multiply by 3 each time.
        for r in &results {
            assert_eq!(r, &vec![27.0 * 1.0, 27.0]);
        }
    }

    #[test]
    fn a_failure_wakes_waiting_members() {
        let fabric = Arc::new(Fabric::default());
        let f2 = fabric.clone();
        let waiter = std::thread::spawn(move || {
            let mut ep = Endpoint::new(f2);
            ep.all_reduce_sum(&[0, 1], 0, &mut [1.0])
        });
        std::thread::sleep(Duration::from_millis(20));
        fabric.fail();
        assert!(matches!(
            waiter.join().expect("joins"),
            Err(ExecError::Aborted)
        ));
    }
}
