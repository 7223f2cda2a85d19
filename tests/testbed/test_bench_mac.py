"""`intml-testbed bench mac`: its recorded streams are the same allreduce with and without the tag, and the CLI
runs end to end at a small size and reports its figures as one JSON object."""

import json
import subprocess
import sys

import pytest
from support.cluster import REPO_ROOT, repo_env

from intml.protocol.siphash import key_words, tag_ref
from intml.protocol.wire import TAG_SIZE
from intml.testbed.bench_mac import KEY, record

pytestmark = pytest.mark.process


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
def test_tagged_stream_is_the_plain_one_with_tags(codec):
    plain, tagged = record(codec, 32, 70, False), record(codec, 32, 70, True)
    assert len(plain) == len(tagged) > 70
    for (p, src), (t, tsrc) in zip(plain, tagged):
        assert src == tsrc and t == p + tag_ref(*key_words(KEY), p)
        assert len(t) == len(p) + TAG_SIZE


def test_bench_mac_json():
    done = subprocess.run([sys.executable, "-m", "intml.testbed", "bench", "mac", "--chunks", "64", "--repeats", "2",
                           "--workers", "2", "--elements", "200000", "--rounds", "2", "--trials", "1", "--cores", "1",
                           "--json"],
                          cwd=REPO_ROOT, env=repo_env(), capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [r["what"] for r in report["per_packet"]["rows"]] == ["cnat8, 1024 elements (1050-byte datagrams)",
                                                                 "int32, 256 elements (1050-byte datagrams)"]
    assert all(r["kernel_ns"] > 0 and r["kernel_mac_ns"] > 0 and r["tag_ns"] > 0 for r in report["per_packet"]["rows"])
    rows = report["allreduce"]["rows"]
    assert [r["mac"] for r in rows] == ["off", "on"] and rows[0]["ratio"] == 1.0
    assert report["allreduce"]["packet_elements"] == 65473  # (65507 - 26 - 8) codes: a tagged datagram still fits
