"""The CLI's progress bar: redrawn in place on a terminal, one finished line elsewhere."""

import io

from ddtree_numba.progress import Progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_log_gets_only_the_finished_line():
    log = io.StringIO()
    with Progress("loading", 4, log) as bar:
        for _ in range(4):
            bar.advance()
    assert log.getvalue() == "loading [####################] 4/4\n"


def test_a_terminal_sees_the_bar_redrawn_then_finished():
    tty = Terminal()
    bar = Progress("decoding", 2, tty)
    bar.advance()
    bar.update(5, total=10)                 # the total may come with the first update
    bar.close()
    bar.close()                             # a second close writes nothing
    assert tty.getvalue() == ("\rdecoding [##########..........] 1/2"
                              "\rdecoding [##########..........]  5/10"
                              "\rdecoding [##########..........]  5/10\n")


def test_an_empty_bar_is_full():
    log = io.StringIO()
    Progress("nothing", 0, log).close()
    assert log.getvalue() == "nothing [####################] 0/0\n"
