"""Errors a user can fix (a config value, a dataset line, a checkpoint, a path, a memory budget),
kept apart from bugs: the jobs print them as one line and exit with USER_ERROR_EXIT_CODE; any other
exception keeps its traceback."""

from __future__ import annotations

USER_ERROR_EXIT_CODE = 2  # as argparse and tyro exit on a bad flag


class UserError(ValueError):
  """A mistake the user can fix. The message names the culprit (file:line, config field, path)
  and what to do, in one or two lines; it is raised where the check is."""
