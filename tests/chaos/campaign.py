"""A chaos campaign on a control plane of its own (etcd and the apiserver get restarted, so it is
not shared with other tests): what the bounded pytest and `make chaos` both run."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path

from controller_runtime.client import ApiClient
from controller_runtime.resources import NAMESPACES
from localstack.storage_stack import require_root
from localstack.testing import start_test_control_plane

from .driver import ChaosConfig, Report, run_campaign


async def campaign(config: ChaosConfig, home: Path | None = None) -> Report:
    require_root()
    cp_home = home or Path(tempfile.mkdtemp(prefix="kl-chaos-cp-", dir="/tmp"))
    # kcm for the protection finalizers and the garbage collector; pods name their node, so no
    # scheduler.
    cp = await start_test_control_plane(cp_home, with_kcm=True, with_scheduler=False)
    clean = False
    try:
        api = await ApiClient.from_kubeconfig(
            str(cp.admin_kubeconfig), qps=0, burst=1, user_agent="kubeloop-chaos"
        )
        try:
            namespace = f"chaos-{uuid.uuid4().hex[:6]}"
            await api.create(NAMESPACES, {"metadata": {"name": namespace}})
            report = await run_campaign(cp, api, namespace, config)
            print(report.summary(), flush=True)
            if config.report_path is not None:
                report.write(config.report_path)
                print(f"report: {config.report_path}", flush=True)
            clean = not report.totals()["failures"]
            return report
        finally:
            await api.close()
    finally:
        await cp.stop()
        # The processes' logs (under logs/) explain a failure: kept then, and named.
        if clean and home is None:
            shutil.rmtree(cp_home, ignore_errors=True)
        elif not clean:
            print(f"control plane and component logs kept in {cp_home / 'logs'}", flush=True)
