"""`intml-testbed bench host-codecs`: its figures are the codecs' own (bits per parameter from the packages' sizes,
the error of the decoded values), printed as a table or as JSON."""

import json

import pytest

from intml.testbed import bench_host_codecs
from intml.testbed.__main__ import main


def test_bits_per_parameter_are_the_packages_sizes(capsys):
    rows = bench_host_codecs.run(3000, 1000, 1, ["uniform8", "signsgd", "randomk1"], as_json=True)
    assert [row["bits_per_parameter"] for row in rows] == [8 + 9 * 8 / 1000, 1, 64]  # header 9 bytes; pairs
    assert rows[2]["rms_error"] == 0 and rows[2]["unbiased"] and not rows[0]["unbiased"]
    assert json.loads(capsys.readouterr().out)["rows"] == rows


def test_command_line_prints_a_table_and_refuses_unknown_codecs(capsys):
    main(["bench", "host-codecs", "--elements", "500", "--package", "100", "--repeats", "1", "--codec", "qsgd4"])
    assert "qsgd4" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "host-codecs", "--codec", "gzip"])
    assert "unknown codec 'gzip'" in capsys.readouterr().err


@pytest.mark.process
def test_allreduce_times_host_codecs_beside_cnat8(capsys):
    """--allreduce: a loopback allreduce per codec, C_nat's first, each bit-identical across its ranks, the ratio
    to C_nat's time in each row."""
    main(["bench", "host-codecs", "--elements", "3000", "--package", "1000", "--repeats", "1", "--codec", "uniform8",
          "--allreduce", "--workers", "2", "--rounds", "1", "--json"])
    out = capsys.readouterr().out
    rows = json.loads(out[out.index("}\n{") + 2:])["rows"]
    assert [row["codec"] for row in rows] == ["cnat8", "uniform8"] and rows[0]["vs_cnat8"] == 1
    assert all(row["identical_across_ranks"] and row["median_s"] > 0 for row in rows)
    assert rows[1]["vs_cnat8"] == rows[1]["median_s"] / rows[0]["median_s"]
