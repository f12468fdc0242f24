#!/usr/bin/env python
"""Is the graphed training step bound by the host or by the device? `scripts/train.py` with the given
flags (use a recipe whose path is the graphed one, on a GPU); once, after step 1000 of pretraining, it
times (1) the host's preparation of 200 packed steps alone (indices, corruption draws, token index,
copies to the device), (2) 200 replays of the step's CUDA graph back to back (device time per step), (3) the
next 200 steps taken as `run` takes them (prepared, then replayed) against their graphs replayed back to back
without preparation, the model and optimizer put back after each (the time between replays: at most what one
CUDA graph for several steps would save), then lets the run go on; at the end, the host's preparation and the
replay calls averaged over all steps. A diagnostic: the 200 replays of (2) train the model further than the run
would. `--nn_embedding` (taken out before the rest goes to train.py) runs the embeddings as plain `nn.Embedding`,
for a side-by-side figure of KnowGPTEmbedding's gradient.

    python benchmarks/diagnostics/graphed_step_host_device.py --recipe handout --attention_type vanilla \\
        --data_dir .data --mixed_precision bf16 --no_do_finetune --output_dir /tmp/g
"""

import sys
import time

import torch

from hf_knowgpt import layers_knowgpt
from hf_knowgpt.commands import cli, train
from hf_knowgpt.training import fast_path

MEASURE_AFTER, COUNT = 1000, 200
prepare, run = fast_path.GraphedStepper._prepare_packed, fast_path.GraphedStepper.run
totals = {"prepare_s": 0.0, "steps": 0, "run_s": 0.0, "measured": False}


def timed_prepare(self, global_step, planned=None):
    started = time.perf_counter()
    capacity = prepare(self, global_step, planned)
    totals["prepare_s"] += time.perf_counter() - started
    totals["steps"] += 1
    return capacity


def steps_as_run_and_graphs_alone(self, first_step, capacities) -> tuple[float, float]:
    """ms per step of `capacities`' steps taken as `run` takes them, each prepared then replayed, and of the same
    graphs replayed back to back without preparation; the model, optimizer and step counter are put back
    after each, so the run goes on from where it was."""
    snapshot = self._snapshot()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for i in range(len(capacities)):
        self.graphs[prepare(self, first_step + i)].replay()
    torch.cuda.synchronize()
    loop_ms = (time.perf_counter() - started) / len(capacities) * 1e3
    self._restore(snapshot)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for capacity in capacities:
        self.graphs[capacity].replay()
    torch.cuda.synchronize()
    replays_ms = (time.perf_counter() - started) / len(capacities) * 1e3
    self._restore(snapshot)
    prepare(self, first_step)  # the inputs of the step the run takes next
    return loop_ms, replays_ms


def measured_run(self, first_step, count, should_stop):
    if not totals["measured"] and first_step >= MEASURE_AFTER and self.packed:
        totals["measured"] = True
        torch.cuda.synchronize()
        started = time.perf_counter()
        capacities = [prepare(self, first_step + i) for i in range(COUNT)]
        torch.cuda.synchronize()
        host_ms = (time.perf_counter() - started) / COUNT * 1e3
        capacity = max(set(capacities), key=capacities.count)
        if capacity in self.graphs:
            prepare(self, first_step)  # the inputs of a real step
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(COUNT):
                self.graphs[capacity].replay()
            end.record()
            torch.cuda.synchronize()
            device_ms = start.elapsed_time(end) / COUNT
            print(f"\n[graphed step] host preparation {host_ms:.3f} ms per step; device, {COUNT} replays of the "
                  f"{capacity}-token graph back to back, {device_ms:.3f} ms per step\n", flush=True)  # fmt: skip
        if all(capacity in self.graphs for capacity in capacities):
            loop_ms, replays_ms = steps_as_run_and_graphs_alone(self, first_step, capacities)
            print(f"[graphed step] the next {COUNT} steps as run() takes them (preparation, then replay) "
                  f"{loop_ms:.4f} ms per step; their graphs replayed back to back, inputs left as they are, "
                  f"{replays_ms:.4f} ms per step; between replays {1e3 * (loop_ms - replays_ms):.1f} µs a step, "
                  "at most what one graph for several steps would save\n", flush=True)  # fmt: skip
    started = time.perf_counter()
    done = run(self, first_step, count, should_stop)
    totals["run_s"] += time.perf_counter() - started
    return done


fast_path.GraphedStepper._prepare_packed = timed_prepare
fast_path.GraphedStepper.run = measured_run
if __name__ == "__main__":
    if "--nn_embedding" in sys.argv:
        sys.argv.remove("--nn_embedding")
        layers_knowgpt.KnowGPTEmbedding.forward = torch.nn.Embedding.forward
        print("[graphed step] embeddings as nn.Embedding", flush=True)
    sys.argv = ["train.py", *sys.argv[1:]]
    try:
        cli.main_guard(train.main)
    finally:
        steps = max(totals["steps"], 1)
        print(f"[graphed step] over {totals['steps']} steps: host preparation {totals['prepare_s'] / steps * 1e3:.3f} "
              f"ms per step; run() calls (preparation and replay launches) {totals['run_s'] / steps * 1e3:.3f} "
              "ms per step", flush=True)  # fmt: skip
