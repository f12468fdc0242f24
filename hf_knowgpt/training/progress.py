"""How training shows its progress: a tqdm bar on a terminal, plain lines in a log file, nothing on the
processes other than the first."""

import os
import sys
import time


class PlainProgress:
    """Progress as plain lines, for a log that is a file (or with progress bars switched off): a line at a
    loss report at most every `interval` seconds, and the last one once, at `close` (readings still arriving
    after the last step update its values); no carriage returns."""

    def __init__(self, total: int, initial: int, interval: float = 5.0):
        self.total, self.n, self.interval = total, initial, interval
        self.last_print, self.values, self.printed_step = time.perf_counter(), {}, None

    def update(self, count: int):
        self.n += count

    def set_postfix(self, **values):
        self.values = values
        if self.n < self.total and time.perf_counter() - self.last_print >= self.interval:
            self._print()

    def _print(self):
        details = ", ".join(f"{name.replace('tok_s', 'tokens/s')} {value}" for name, value in self.values.items())
        print(f"training: step {self.n}/{self.total}" + (f", {details}" if details else ""), flush=True)
        self.last_print, self.printed_step = time.perf_counter(), self.n

    def close(self):
        if self.printed_step != self.n:
            self._print()


class NoProgress:
    def update(self, count):
        pass

    def set_postfix(self, **values):
        pass

    def close(self):
        pass


def progress_bar(total: int, initial: int, disable: bool):
    """A tqdm bar on a terminal; plain lines in a log file, or where bars are switched off (TQDM_DISABLE=1,
    HF_HUB_DISABLE_PROGRESS_BARS=1 or transformers' disable_progress_bar()); nothing off the main process."""
    from transformers.utils import logging as transformers_logging

    if disable:
        return NoProgress()
    bars_off = not transformers_logging.is_progress_bar_enabled() or os.environ.get("TQDM_DISABLE", "") not in (
        "",
        "0",
    )
    if bars_off or not sys.stderr.isatty():
        return PlainProgress(total, initial)
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="training", dynamic_ncols=True)


__all__ = ["NoProgress", "PlainProgress", "progress_bar"]
