# The commands the README gives. Tests talk to the real local PostgreSQL and
# RabbitMQ (see docs/testing.md).

GO ?= go
TEST_FLAGS ?=

SHELL := /bin/bash

.PHONY: test vet fmt-check demo services chaos chaos-cluster chaos-mutants bench generate audit fuzz

## test: gofmt check, go vet, and every test with the race detector. The
## end-to-end suite (short chaos profile) runs last and alone: it stops and
## starts the whole RabbitMQ application, which other packages' tests use.
test: fmt-check vet
	$(GO) test -race -count=1 -timeout 30m $(TEST_FLAGS) $$($(GO) list ./... | grep -v '/e2e$$')
	@# go test shows no output of a passing package without -v: ask the two
	@# packages with replica-set tests to say how many of those did not run, and why.
	@$(GO) test -race -count=1 -v -run '^(TestTransactionMode|TestAppSuiteInTransactionMode)' ./pkg/inbox/ ./services/shipping/internal/app/ 2>&1 | grep -E '^(inboxtest|replsettest):' || true
	CHAOS_BROKER_RESTART=true $(GO) test -race -count=1 -v -timeout 20m $(TEST_FLAGS) ./e2e/ 2>&1 | grep -v '^=== \(RUN\|PAUSE\|CONT\)'; exit $${PIPESTATUS[0]}

## chaos: the long end-to-end profile (about 10 minutes, ~150 faults of every
## kind), with the polling relay, then again with the WAL relay
## (CHAOS_RELAY_MODE=wal). The reports go to $$CHAOS_REPORT (default
## e2e/chaos-report.json) and e2e/chaos-report-wal.json.
chaos: services
	CHAOS_PROFILE=long CHAOS_BROKER_RESTART=true $(GO) test -race -count=1 -v -run '^TestChaos$$' -timeout 60m ./e2e/
	CHAOS_PROFILE=long CHAOS_BROKER_RESTART=true CHAOS_RELAY_MODE=wal CHAOS_REPORT=chaos-report-wal.json $(GO) test -race -count=1 -v -run '^TestChaos$$' -timeout 60m ./e2e/

## chaos-cluster: the flow on a three-node RabbitMQ cluster of the run's own
## (beside this machine's broker, untouched; each node in a network namespace
## of its own), with node faults (SIGKILL of a node, of the shipping queue's
## leader and of two nodes at once, stop_app/start_app, a node cut from the
## clients, a node wiped and joined again, a partition between nodes, a
## resource alarm) and every process fault, with the polling relay, then again
## with the WAL relay; about 40 minutes on two cores, not part of test. Needs root and the
## rabbitmq user. Reports: $$CHAOS_REPORT (default e2e/chaos-report.json) and
## e2e/chaos-report-cluster-wal.json. See docs/cluster.md.
chaos-cluster: services
	CHAOS_PROFILE=cluster $(GO) test -race -count=1 -v -run '^(TestRabbitCluster|TestChaosClusterPartition|TestChaos)$$' -timeout 60m ./e2e/
	CHAOS_PROFILE=cluster CHAOS_RELAY_MODE=wal CHAOS_REPORT=chaos-report-cluster-wal.json $(GO) test -race -count=1 -v -run '^TestChaos$$' -timeout 60m ./e2e/

## chaos-mutants: the proof that the chaos proof can fail. The short chaos
## profile (TestChaos, the machine's broker left running), once per planted
## bug of e2e/chaos.Mutants, one at a time, each with the services built with
## the bug's tag (CHAOS_BUILD_TAGS=mutant_<name>) and a report of its own
## (e2e/mutant-reports/<name>.json, its log beside it); then the matrix:
## mutant, seed, caught or not, the invariants and violation kinds seen.
## Fails unless every mutant is caught. 30 to 40 minutes on two cores, not
## part of test. MUTANTS=a,b runs only those. See docs/chaos.md.
MUTANTS ?=
chaos-mutants: services
	$(GO) run ./e2e/chaos/mutantmatrix -only '$(MUTANTS)'

## fuzz: run each fuzz target for FUZZTIME (default 2m each), from its
## committed corpus (testdata/fuzz) on: any message Enqueue accepts is
## published by each relay, anything else is refused with ErrInvalidMessage;
## any amendment body the orders API validates is refused on its note or
## carried unchanged by its order.amended event. make test replays the corpus only. A failing input is written to the
## target's testdata/fuzz: commit it with its fix.
FUZZTIME ?= 2m
fuzz: services
	$(GO) test -count=1 -run '^$$' -fuzz '^FuzzEnqueueToPollingRelay$$' -fuzztime $(FUZZTIME) ./pkg/outbox/
	$(GO) test -count=1 -run '^$$' -fuzz '^FuzzEnqueueToWALRelay$$' -fuzztime $(FUZZTIME) ./pkg/outbox/outboxwal/
	$(GO) test -count=1 -run '^$$' -fuzz '^FuzzAmendRequest$$' -fuzztime $(FUZZTIME) ./services/orders/internal/order/

## bench: measure the performance goals of docs/guarantees.md against their baselines
## (15 to 20 minutes, relay_start_backlog's million-row drains included; not part
## of test). See docs/benchmarks.md.
bench: services
	$(GO) run ./bench

## audit: one loss audit of the demo's databases (make demo without Docker:
## the outbox in orders_demo, shipping's inbox on the embedded FerretDB at
## 127.0.0.1:27017/shipping; DATABASE_URL and MONGO_URI point elsewhere):
## the JSON report, exit 1 when an event is missing or an inbox record is a
## phantom. AUDIT_FLAGS adds flags; its default grace of one minute judges
## the demo's recent events. See docs/audit.md.
AUDIT_FLAGS ?= -grace 1m
audit:
	DATABASE_URL="$${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/orders_demo?sslmode=disable}" \
	MONGO_URI="$${MONGO_URI:-mongodb://127.0.0.1:27017/shipping}" \
	$(GO) run ./cmd/audit $(AUDIT_FLAGS)

## generate: regenerate the orders store's queries with the pinned sqlc
## (services/orders/internal/postgres/sqlc.yaml) and record the checksums a
## test compares. The first run builds sqlc (a few minutes; then cached).
generate:
	cd services/orders/internal/postgres && $(GO) run github.com/sqlc-dev/sqlc/cmd/sqlc@v1.31.1 generate
	$(GO) test -count=1 -run '^TestGeneratedQueriesAreCurrent$$' ./services/orders/internal/postgres/ -update

vet:
	$(GO) vet ./...

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

## services: start this machine's PostgreSQL and RabbitMQ if they are down.
services:
	bash deploy/local/ensure-services.sh

## demo: the whole system (guided tour: docs/demo.md), with a live view of
## the flow on http://127.0.0.1:8090 (it prints the address). With a Docker
## engine: docker compose up --build --detach --wait (deploy/docker-compose.yml),
## then bin/demo -compose serves the page from the host; without one: local
## processes against this machine's PostgreSQL and RabbitMQ and an embedded
## FerretDB. Ctrl-C stops it; DEMO_LOAD=1 adds a load generator.
demo:
	GO=$(GO) bash deploy/demo.sh
