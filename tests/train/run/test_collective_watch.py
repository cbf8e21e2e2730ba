"""`train.run.collective_watch`: one error line, exit 1, before XLA's collective timeout would abort a run
whose host devices wait at a collective."""

import subprocess
import sys
import time

from train.run import collective_watch
from train.run.collective_watch import TERMINATE_FLAG, CollectiveWatch, terminate_timeout_s, watch_for


def test_the_timeout_is_the_last_one_xla_flags_set_else_xla_s_default():
    assert terminate_timeout_s("") == collective_watch.XLA_DEFAULT_SECONDS
    assert terminate_timeout_s(f"--xla_force_host_platform_device_count=2 {TERMINATE_FLAG}=3600") == 3600
    assert terminate_timeout_s(f"{TERMINATE_FLAG}=3600 {TERMINATE_FLAG}=12.5") == 12.5


def test_a_run_on_one_device_or_an_accelerator_has_no_watch():
    assert watch_for(1, True) is None and watch_for(8, False) is None


def test_a_wait_past_the_deadline_ends_with_one_line_naming_the_cause_and_the_settings():
    messages = []
    watch = CollectiveWatch(2, timeout_s=0.5, end=messages.append)
    with watch.waiting():
        time.sleep(0.2)  # within the deadline (0.45 s): nothing
        assert messages == []
        time.sleep(0.6)
    assert len(messages) == 1
    line = messages[0]
    assert line.startswith("error: ") and "\n" not in line
    assert "2 host devices" in line and f"{TERMINATE_FLAG}=0.5" in line and "--cpu-devices 1" in line


def test_the_process_ends_with_exit_1_and_the_line_on_stderr_even_while_its_main_thread_is_blocked():
    code = ("import threading, time\n"
            "from train.run.collective_watch import CollectiveWatch\n"
            "watch = CollectiveWatch(2, timeout_s=1.0)\n"
            "with watch.waiting():\n"
            "    threading.Event().wait(30)  # a main thread blocked, as in XLA's wait\n"
            "print('not reached')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "not reached" not in done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: a chunk of training steps has waited")
