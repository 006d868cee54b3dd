"""The hint for a value starting with '-', and none where a positional is missing."""


def test_a_value_starting_with_a_dash_says_how_to_give_it(offload_cli):
    # argparse takes '-1MiB' for another flag: the one line says to write --size=VALUE
    rc, out, err = offload_cli(["bench", "io", "--size", "-1MiB"])
    assert rc == 2 and out == ""
    assert err.count("\n") == 1, err
    assert err.startswith("offload bench io: --size: expected one argument; give its value "
                          "after it, or as --size=VALUE where the value starts with '-'"), err
    # given that way, the value itself is checked (and refused: not a byte size)
    rc, out, err = offload_cli(["bench", "io", "--size=-1MiB"])
    assert rc == 2 and "--size: '-1MiB' is not a byte size" in err, err


def test_a_missing_positional_value_gets_no_dash_hint(offload_cli):
    rc, _, err = offload_cli(["checkpoint", "info"])
    assert rc == 2 and "VALUE where" not in err, err
