"""The scenarios' command lines: an argument error is one line naming the scenario, status 2
(argparse's default dumps the whole usage, which buries the reason)."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)
