"""Make a process whose native code fails exit at once instead of hanging.

Importing Paddle installs C-level handlers for SIGSEGV, SIGILL, SIGFPE, SIGABRT, SIGBUS and SIGTERM that
print a C++ traceback (paddle::framework::SignalHandle), which calls malloc. When glibc aborts on a corrupt
heap ("double free or corruption", "malloc(): unaligned tcache chunk detected") it still holds the malloc
arena's lock, so that handler deadlocks in malloc: the process sleeps in a futex for ever. A SIGTERM then
lands in the same handler, which waits for the first one to finish, so only SIGKILL ended the process.
With the default dispositions the process dies of the signal (an abort is exit status -6) and its parent,
a supervisor or a test sees it.
"""
from __future__ import annotations

import logging
import signal

logger = logging.getLogger(__name__)

# The signals Paddle's import takes over (paddle/fluid/platform/init.cc, SignalErrorStrings).
FATAL_SIGNALS = (signal.SIGSEGV, signal.SIGILL, signal.SIGFPE, signal.SIGABRT, signal.SIGBUS, signal.SIGTERM)


def restore_default_fatal_signals() -> None:
    """Put back the default disposition of FATAL_SIGNALS, keeping any handler set from Python.

    Paddle replaced Python's handlers at the C level without Python knowing: signal.getsignal() still
    names them, so each one it names (a function or SIG_IGN) is installed again. faulthandler enabled before
    Paddle's import was displaced the same way; enable it after importing fastdeploy (the server does).
    """
    import paddle

    paddle.disable_signal_handler()  # Paddle's own undo: SIG_DFL for each signal it took
    for sig in FATAL_SIGNALS:
        handler = signal.getsignal(sig)
        if callable(handler) or handler == signal.SIG_IGN:
            try:
                signal.signal(sig, handler)
            except ValueError:  # only the main thread may set handlers; the default stays
                logger.warning("imported outside the main thread: the Python handler of %s is no longer called",
                               signal.Signals(sig).name)
