"""Errors in what a user gave (a file, a folder, a flag), as opposed to faults in the code.

The scripts report them as one line, `error: <where>: <what is wrong> (<what to do>)`, and exit with
status 2, without a traceback (`--debug` or KNOWGPT_DEBUG=1 shows it); any other exception keeps its
traceback. Each is also the ValueError or FileNotFoundError a library caller would expect.
"""


class UserError:
    """Mixin of the user-error exceptions: `where` (a path, a path:line, or flags), `problem`, `remedy`."""

    def __init__(self, where, problem: str, remedy: str | None = None):
        self.where, self.problem, self.remedy = str(where), problem, remedy
        super().__init__(self.line())

    def line(self) -> str:
        return f"{self.where}: {self.problem}" + (f" ({self.remedy})" if self.remedy else "")


class InputError(UserError, ValueError):
    """Something the user gave is wrong: a malformed line, a folder that is not a checkpoint, flags that
    contradict each other, an output folder that holds another run."""


class MissingInputError(UserError, FileNotFoundError):
    """A file or folder the user named does not exist."""


class OutputError(UserError, OSError):
    """A folder the user named cannot take what is written there: its disk is full."""


__all__ = ["InputError", "MissingInputError", "OutputError", "UserError"]
