# The commands a person types. Each one installs what it needs first (Debian packages, the Python
# virtualenv, generated gRPC stubs, the pinned Go binaries), and a second run skips what is done.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: up down test unit integration sanity stress-start bench bench-scaling profile lint deps binaries prometheus-deps system-deps python-deps clean \
	docker-deps images wheels compose-test conformance kind-deps helm-deps kind-images kind-up kind-down kind-test e2e-deps \
	e2e-storage e2e-storage-disruptive e2e-csi-mock chaos bench-driver bench-driver-stack go-sidecars

# exec: the launcher is make's own child, not a shell's (bash execs a lone command anyway; this keeps
# it so), so the SIGTERM make passes on to its child reaches the launcher, which stops in order.
# DRIVER=path/to/recipe.yaml: the same stack on the CSI driver a driver-bench recipe describes
# (docs/driver-bench.md, "Testing your CSI driver with kubeloop") instead of kubeloop's own.
# SIDECARS=go: upstream's Go csi-provisioner, csi-attacher and csi-resizer in place of kubeloop's.
up: deps binaries $(if $(PROMETHEUS),prometheus-deps) $(if $(filter go,$(SIDECARS)),go-sidecars)
	exec $(PY) -m localstack.main up --pools=$(or $(POOLS),shared) --pool-capacity="$(POOL_CAPACITY)" $(if $(PROMETHEUS),--prometheus) \
		$(if $(DRIVER),--driver-recipe="$(DRIVER)") $(if $(SIDECARS),--sidecars=$(SIDECARS))

# Stops the stack of `make up` (the one on $KUBELOOP_HOME) from another terminal, in order, and
# checks that it left no mount or loop device behind.
down: python-deps
	$(PY) -m localstack.main down

# tests/compose (docker-compose end to end) needs docker, docker-compose and debootstrap; tests/kind
# also kind, containerd, kubelet, kubeadm and external-snapshotter (kind-deps), and e2e.test (e2e-deps).
test: deps binaries docker-deps kind-deps e2e-deps helm-deps prometheus-deps
	@# Lint first (ruff, ruff format, mypy strict): a minute, and a type error fails here, not in a test.
	@$(MAKE) --no-print-directory lint
	@# The conformance subset (tests/conformance) compares kubeloop with the Go sidecars.
	@bash tools/build-binaries.sh external-provisioner external-attacher external-resizer
	$(PY) -m pytest $(PYTEST_ARGS)

unit: python-deps helm-deps
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

# tests/integration/test_grpc_lite_peers.py talks to the e2e suite's Go mock CSI driver (csi-mock).
integration: deps binaries
	@bash tools/build-binaries.sh csi-mock
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

sanity: deps binaries
	$(PY) -m pytest tests/csi -k sanity $(PYTEST_ARGS)

# The long version of the start-race tests that `make test` runs a few rounds of: 50 rounds of a
# controller and three node drivers started together on one pool, 20 whole-stack start/stop rounds.
stress-start: deps binaries
	KUBELOOP_POOL_START_ROUNDS=50 KUBELOOP_STACK_ROUNDS=20 $(PY) -m pytest -s \
		tests/unit/test_shared_files.py tests/csi/test_shared_pool.py tests/e2e/test_stack_restarts.py $(PYTEST_ARGS)

# The long chaos campaign (docs/chaos.md); `make test` runs a bounded one (tests/chaos). Each round
# kills CHAOS_KILLS kubeloop processes during a workload, with apiserver/etcd restarts, pauses past
# a lease and pool fills every few rounds, then checks the invariants; a JSON report is written.
CHAOS_ROUNDS ?= 40
CHAOS_KILLS ?= 5
CHAOS_SEED ?= 1
CHAOS_REPORT ?= chaos-report.json

chaos: deps binaries
	CHAOS_ROUNDS=$(CHAOS_ROUNDS) CHAOS_KILLS=$(CHAOS_KILLS) CHAOS_SEED=$(CHAOS_SEED) \
		CHAOS_REPORT=$(CHAOS_REPORT) $(PY) -m tests.chaos

# The driver bench (docs/driver-bench.md): a CSI driver run from its recipe, its volume lifecycle
# under every fault (kill -9 before or after a call, a timeout, a duplicate, a lost answer) through
# a fault-injecting proxy; the report and a reproducer per finding go to BENCH_DRIVER_OUT. Replay
# one with `$(PY) -m driver_bench.main replay FILE`. `make test` runs kubeloop's sweep (tests/driver_bench).
RECIPE ?= driver_bench/recipes/kubeloop.yaml
BENCH_DRIVER_OUT ?= .kubeloop/driver-bench
BENCH_DRIVER_ARGS ?=

bench-driver: deps
	$(PY) -m driver_bench.main campaign --recipe $(RECIPE) --out $(BENCH_DRIVER_OUT) $(BENCH_DRIVER_ARGS)

# The same faults through the whole local stack on the recipe's driver, one stack per scenario on
# make up's fixed ports (so not beside a running `make up`); docs/driver-bench.md, "The stack campaign".
bench-driver-stack: deps binaries go-sidecars
	$(PY) -m driver_bench.main stack-campaign --recipe $(RECIPE) --out $(BENCH_DRIVER_OUT)-stack $(BENCH_DRIVER_ARGS)

# Upstream's Go controller sidecars, for SIDECARS=go, the stack campaign's second opinion, the
# conformance suite and the side-by-side benchmarks.
go-sidecars:
	@bash tools/build-binaries.sh external-provisioner external-attacher external-resizer

# Every differential conformance scenario (docs/conformance.md): each run against kcm's storage
# controllers and the Go sidecars, then against kubeloop, and compared. `make test` runs a subset.
conformance: deps binaries
	@bash tools/build-binaries.sh external-provisioner external-attacher external-resizer
	$(PY) -m tests.conformance.suite $(CONFORMANCE_ARGS)

# One benchmark: `make bench BENCHES=binding`. Each prints a table and writes bench/results/<name>.json.
BENCHES ?= informer_sync csi_driver datapath binding provisioning node_provisioning attach expansion

bench: deps binaries
	@# The Go sidecars are built only for the side-by-side benchmarks.
	@bash tools/build-binaries.sh external-provisioner external-attacher external-resizer
	@for b in $(BENCHES); do echo "== bench.$$b"; $(PY) -m bench.$$b || exit 1; done
	@# The generated tables of docs/benchmarks.md, from every method result in bench/results.
	$(PY) -m bench.report

# The scaling curves (docs/benchmarks.md, "Scaling"): binding, provisioning and attach at several
# sizes, kubeloop and Go alternating at each. `make bench-scaling SCALING_POINTS=binding:100,attach:100`
# runs chosen points; the default, all nine, takes hours on 2 cores.
SCALING_POINTS ?= binding:100,binding:1000,binding:5000,provisioning:100,provisioning:1000,provisioning:5000,attach:100,attach:500,attach:1000
SCALING_ROUNDS ?= 1

bench-scaling: deps binaries
	@bash tools/build-binaries.sh external-provisioner external-attacher
	$(PY) -m bench.scaling --points $(SCALING_POINTS) --rounds $(SCALING_ROUNDS)
	$(PY) -m bench.report

# Where a pod's time goes on the attach path (docs/benchmarks.md, "Profiling"): py-spy on every
# kubeloop process during one pass of PROFILE_PODS pods; writes .kubeloop/profile/.
PROFILE_PODS ?= 20

profile: deps binaries
	$(PY) -m bench.profile --pods $(PROFILE_PODS) $(PROFILE_ARGS)

lint: python-deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy controller_runtime services csi_driver external_provisioner external_attacher external_resizer node_plugin node_driver_registrar livenessprobe node_finalizer snapshot_metadata_setup kubectl_kubeloop localstack tests bench driver_bench

deps: system-deps python-deps

system-deps:
	@bash tools/install-system-deps.sh

# The stamp is newer than pyproject.toml once the venv matches it; generate.py skips itself
# when the stubs already match tools/versions.env.
python-deps: $(VENV)/.installed
	@$(PY) proto/generate.py

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# compat mode puts the checkout itself on sys.path, so kubeloop_grpc, generated after this
	@# install, is importable from anywhere too.
	$(PY) -m pip install -q -e '.[test,bench]' --config-settings editable_mode=compat
	@touch $@

binaries:
	@bash tools/build-binaries.sh

# docker-compose: Debian's docker.io, containerd, runc, docker-compose and debootstrap.
docker-deps:
	@bash tools/docker-env.sh install

# Every image docker-compose.yml runs, built here without a registry (docs/compose.md). Starts a
# local-only dockerd when none answers and leaves it running; `tools/docker-env.sh stop` stops it.
images: deps binaries docker-deps
	PYTHON=$(PY) bash tools/build-images.sh

# Only build/wheels/, what `docker-compose up --build` needs on a machine that reaches a registry.
wheels: python-deps
	PYTHON=$(PY) bash tools/build-images.sh wheels

compose-test: deps binaries docker-deps
	$(PY) -m pytest tests/compose $(PYTEST_ARGS)

# kind (docs/kind.md): kind, containerd, kubelet, kubeadm and kube-proxy built through the Go module
# proxy; the offline node image and every image the cluster runs; a cluster with kubeloop deployed.
kind-deps: docker-deps helm-deps
	@bash tools/build-binaries.sh kind snapshotter snapshot-metadata

# helm, which tests/unit/test_helm_chart.py lints and renders deploy/helm/kubeloop with and
# `make kind-up KIND_POOLS=separate` installs the chart with.
helm-deps:
	@bash tools/build-binaries.sh helm

# Prometheus and promtool (deploy/prometheus): promtool tests the alerting rules in make test;
# `make up PROMETHEUS=1` runs Prometheus beside the local stack.
prometheus-deps:
	@bash tools/build-binaries.sh prometheus

# Kubernetes' e2e.test and agnhost, and the e2e suite's mock CSI driver as a command (docs/e2e-storage.md).
e2e-deps:
	@bash tools/build-binaries.sh e2e csi-mock

kind-images: deps binaries kind-deps
	PYTHON=$(PY) bash tools/build-kind-node.sh

# KIND_POOLS=separate: three workers, each its own pool, nothing shared; kubeloop installed by the
# Helm chart in node-local mode (docs/node-local.md). `make kind-down` removes either.
KIND_POOLS ?= shared
# KIND_CONTROLLERS=cluster: a cluster as users have it, kube-controller-manager with every default
# controller (it binds, attaches and expands), kubelet in /var/lib/k0s/kubelet, the Helm chart with
# its defaults; kubeloop (the default): kcm's three storage controllers off, kubeloop's deployed.
KIND_CONTROLLERS ?= kubeloop

kind-up: deps binaries kind-deps
	$(PY) -m localstack.kind up --pools $(KIND_POOLS) --storage-controllers $(KIND_CONTROLLERS)

kind-down: python-deps
	$(PY) -m localstack.kind down

# tests/kind (shared pool) then tests/kind_local (separate pools, node-local mode): one cluster at a
# time, each created for its package and deleted after it.
kind-test: deps binaries kind-deps
	$(PY) -m pytest tests/kind tests/kind_local $(PYTEST_ARGS)

# The Kubernetes external-storage e2e suite against kubeloop in kind (docs/e2e-storage.md): builds
# e2e.test and agnhost, brings the cluster up (or reuses it), runs the suite, writes the JUnit report
# and a summary under .kubeloop/e2e-storage/ (e2e-storage-disruptive: .kubeloop/e2e-storage-disruptive/),
# and takes the cluster down. Not part of `make test`, which runs a few minutes of it (tests/kind): the
# non-disruptive specs take about 50 minutes, the Disruptive and Serial ones longer.
# E2E_MODE=node-local runs the suite against the cluster of `make kind-up KIND_POOLS=separate` (each
# node its own pool, the Helm chart in node-local mode), with results under .kubeloop/e2e-storage-node-local/.
# E2E_CONTROLLERS=cluster runs it with kube-controller-manager's own storage controllers (KIND_CONTROLLERS
# above), results under .kubeloop/e2e-storage[-node-local]-cluster/.
E2E_MODE ?= shared
E2E_CONTROLLERS ?= kubeloop
E2E_POOLS := $(if $(filter node-local,$(E2E_MODE)),separate,shared)
E2E_SUFFIX := $(if $(filter node-local,$(E2E_MODE)),-node-local,)$(if $(filter cluster,$(E2E_CONTROLLERS)),-cluster,)
E2E_CLASS := $(if $(filter node-local,$(E2E_MODE)),--storage-class kubeloop-wffc,)

e2e-storage: deps binaries kind-deps e2e-deps
	$(PY) -m localstack.kind up --pools $(E2E_POOLS) --storage-controllers $(E2E_CONTROLLERS)
	$(PY) -m localstack.e2e_storage run --results .kubeloop/e2e-storage$(E2E_SUFFIX) $(E2E_CLASS) $(E2E_ARGS); rc=$$?; \
		$(PY) -m localstack.kind down; exit $$rc

# The e2e suite's CSI Mock specs (localstack/csi_mock.py, docs/e2e-storage.md): its mock driver, run inside
# e2e.test, behind kubeloop's sidecars in the suite's own mock manifests; results in .kubeloop/e2e-csi-mock/.
e2e-csi-mock: deps binaries kind-deps e2e-deps
	$(PY) -m localstack.kind up --pools shared --storage-controllers $(E2E_CONTROLLERS)
	$(PY) -m localstack.e2e_storage run --suite csi-mock --results .kubeloop/e2e-csi-mock$(E2E_SUFFIX) $(E2E_ARGS); \
		rc=$$?; $(PY) -m localstack.kind down; exit $$rc

e2e-storage-disruptive: deps binaries kind-deps e2e-deps
	$(PY) -m localstack.kind up --pools $(E2E_POOLS) --storage-controllers $(E2E_CONTROLLERS)
	$(PY) -m localstack.e2e_storage run --suite disruptive --results .kubeloop/e2e-storage-disruptive$(E2E_SUFFIX) \
		$(E2E_CLASS) $(E2E_ARGS); rc=$$?; $(PY) -m localstack.kind down; exit $$rc

clean:
	rm -rf kubeloop_grpc .kubeloop build *.egg-info
