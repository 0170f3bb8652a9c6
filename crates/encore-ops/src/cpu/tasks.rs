//! How a product's weight rows are split into tasks on the worker pool:
//! each task takes whole weight rows and writes its own slice of every
//! output row. Shared by the row-at-a-time products (`matmul.rs`) and the
//! tiled ones (`gemm/`), which choose between each other and so must not
//! depend on each other for it.
//!
//! The tasks run on the worker pool installed on the calling thread
//! ([`encore::parallel`]; the CPU backend installs one on its queue thread),
//! or one after another where there is none.

use encore::parallel;

/// Work (weight bytes x activation rows) below which one thread does the whole
/// product: below it, what a second thread saves is about what handing it
/// work costs.
const SERIAL_WORK: usize = 64 * 1024;
/// Tasks per thread, so that a thread slowed down by others is caught up.
const TASKS_PER_THREAD: usize = 4;
/// The fewest weight rows a task takes.
const MIN_TASK_ROWS: usize = 16;

/// Splits a product of `weights` (whole rows of `row_bytes`) with `m`
/// activation rows into tasks of whole weight rows and runs `chunk` on each,
/// on the worker pool: `chunk(w, out)` gets a task's weight rows and, for
/// each activation row `j`, `out[j]`, the outputs of those weight rows.
pub(super) fn for_each_task(
    weights: &[u8],
    row_bytes: usize,
    m: usize,
    y: &mut [f32],
    chunk: impl Fn(&[u8], &mut [&mut [f32]]) + Sync,
) {
    if m == 0 || y.is_empty() {
        return;
    }
    let rows = y.len() / m;
    let task_rows = task_rows(rows, row_bytes.saturating_mul(m));
    if m == 1 {
        if task_rows >= rows {
            chunk(weights, &mut [y]);
        } else {
            let task_bytes = task_rows * row_bytes;
            parallel::for_each_chunk_mut(y, task_rows, |t, out| {
                let w = weights.get(t * task_bytes..).unwrap_or(&[]);
                chunk(&w[..w.len().min(task_bytes)], &mut [out]);
            });
        }
        return;
    }
    // Task t writes piece t of every output row.
    let mut tasks: Vec<Vec<&mut [f32]>> = (0..rows.div_ceil(task_rows))
        .map(|_| Vec::with_capacity(m))
        .collect();
    for out_row in y.chunks_mut(rows) {
        for (task, piece) in tasks.iter_mut().zip(out_row.chunks_mut(task_rows)) {
            task.push(piece);
        }
    }
    if let [only] = tasks.as_mut_slice() {
        chunk(weights, only);
    } else {
        let task_bytes = task_rows * row_bytes;
        parallel::for_each_mut(&mut tasks, |t, out| {
            let w = weights.get(t * task_bytes..).unwrap_or(&[]);
            chunk(&w[..w.len().min(task_bytes)], out);
        });
    }
}

/// Weight rows per task: everything in one task for small products, else
/// about `TASKS_PER_THREAD` tasks per thread, in multiples of 4 rows (whole tiles).
fn task_rows(rows: usize, work_per_row: usize) -> usize {
    let threads = parallel::threads();
    if threads <= 1 || rows.saturating_mul(work_per_row) < SERIAL_WORK {
        return rows.max(1);
    }
    rows.div_ceil(threads * TASKS_PER_THREAD)
        .next_multiple_of(4)
        .max(MIN_TASK_ROWS)
}
