"""The torch.distributed rendezvous store (no authentication) listens only where it was asked to:
on a loopback address rank 0 binds 127.0.0.1, not every address (torch's TCPStore default)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from gridserve.launcher import free_port


def test_a_loopback_rendezvous_listens_only_on_loopback():
    port = free_port()
    script = textwrap.dedent(f"""
        import sys, torch, torch.distributed as dist, psutil
        from gridserve.services.worker.parallel_state import init_distributed
        from gridserve.shared.parallel import RankLayout
        init_distributed(RankLayout(rank=0, tp_size=1, pp_size=1), "127.0.0.1:{port}", torch.device("cpu"))
        listening = {{c.laddr.ip for c in psutil.Process().net_connections("inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == {port}}}
        print(sorted(listening))
        dist.destroy_process_group()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['127.0.0.1']"
