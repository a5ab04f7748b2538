"""Sphinx directive ``fastanneal-help``: the ``--help`` text of the ``fastanneal`` command.

Usage (reST)::

    .. fastanneal-help::            (the top-level parser)
    .. fastanneal-help:: cluster    (a sub-command)

The text comes from :func:`fastanneal._cli_parser.build_parser` at build time, rendered as a
literal block at a fixed width, so the page cannot drift from the parser and the build needs
no extra dependency and no subprocess.
"""
import argparse
import os
import re
from contextlib import contextmanager

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

WIDTH = 90
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@contextmanager
def _columns(width):
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)       # argparse wraps at shutil.get_terminal_size()
    try:
        yield
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def help_text(command=None, width=WIDTH):
    """The ``--help`` text of ``fastanneal`` (``command=None``) or of one sub-command."""
    from fastanneal._cli_parser import build_parser
    with _columns(width):
        parser = build_parser()
        if command is not None:
            subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            choices = subs[0].choices if subs else {}
            if command not in choices:
                raise ValueError(f"fastanneal has no sub-command {command!r}; "
                                 f"known: {', '.join(choices)}")
            parser = choices[command]
        return _ANSI.sub("", parser.format_help())   # Python >= 3.14 may colour the help


class FastannealHelp(SphinxDirective):
    optional_arguments = 1
    has_content = False

    def run(self):
        command = self.arguments[0] if self.arguments else None
        try:
            text = help_text(command)
        except ValueError as exc:
            raise self.error(str(exc)) from None
        prompt = "$ fastanneal " + (f"{command} " if command else "") + "--help\n"
        block = nodes.literal_block(prompt + text, prompt + text)
        block["language"] = "text"
        return [block]


def setup(app):
    app.add_directive("fastanneal-help", FastannealHelp)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
