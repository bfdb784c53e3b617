# The commands the README gives. Tests talk to the real local PostgreSQL and
# RabbitMQ (see README, "Running the tests").

GO ?= go
TEST_FLAGS ?=

.PHONY: test vet fmt-check demo services

## test: gofmt check, go vet, and every test with the race detector.
test: fmt-check vet
	$(GO) test -race -count=1 -timeout 40m $(TEST_FLAGS) ./...

vet:
	$(GO) vet ./...

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

## services: start this machine's PostgreSQL and RabbitMQ if they are down.
services:
	bash deploy/local/ensure-services.sh

## demo: the whole system (guided tour: docs/demo.md). With a Docker engine:
## docker compose up --build (deploy/docker-compose.yml); without one: local
## processes against this machine's PostgreSQL and RabbitMQ and an embedded
## FerretDB. Ctrl-C stops it; DEMO_LOAD=1 adds a load generator.
demo:
	GO=$(GO) bash deploy/demo.sh
