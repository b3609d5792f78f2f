"""What `slatrace run` adds to a BPF load failure, from the process's own status."""

from agent.daemon import seccomp_hint

STATUS = "Name:\tslatrace\nNoNewPrivs:\t1\nSeccomp:\t{mode}\nSeccomp_filters:\t{filters}\n"


def test_a_seccomp_filter_is_named_with_the_profile_that_allows_bpf():
    hint = seccomp_hint(STATUS.format(mode=2, filters=1))
    assert "seccomp" in hint and "deploy/seccomp/slatrace.json" in hint


def test_no_hint_without_a_filter():
    assert seccomp_hint(STATUS.format(mode=0, filters=0)) == ""
    # Strict mode (1) cannot run Python at all; only filter mode can refuse bpf() selectively.
    assert seccomp_hint(STATUS.format(mode=1, filters=0)) == ""
