package copycheck

import (
	"os/exec"
	"strings"
	"testing"
)

// TestPackagesStayFreeOfTheOpenTelemetrySDK: pkg/outbox and pkg/inbox never
// import the OpenTelemetry SDK, pkg/inbox not even its API, and their
// optional instrumentation packages only the API (the SDK, the exporter and
// the sampler are the application's choice); and pkg/outbox and
// pkg/outbox/publishertest import no broker client. Test files are not
// counted.
func TestPackagesStayFreeOfTheOpenTelemetrySDK(t *testing.T) {
	for _, tc := range []struct {
		pkg       string
		forbidden []string
	}{
		{"./pkg/inbox", []string{"go.opentelemetry.io/"}},
		{"./pkg/inbox/inboxotel", []string{"go.opentelemetry.io/otel/sdk", "go.opentelemetry.io/otel/exporters"}},
		{"./pkg/outbox/...", []string{"go.opentelemetry.io/otel/sdk", "go.opentelemetry.io/otel/exporters"}},
		// The core and its conformance kit import no broker's client: each
		// publisher is a package of its own.
		{"./pkg/outbox", []string{"github.com/rabbitmq/", "github.com/nats-io/"}},
		{"./pkg/outbox/publishertest", []string{"github.com/rabbitmq/", "github.com/nats-io/"}},
	} {
		cmd := exec.Command("go", "list", "-deps", tc.pkg)
		cmd.Dir = "../.."
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("go list -deps %s: %v\n%s", tc.pkg, err, out)
		}
		for _, dep := range strings.Fields(string(out)) {
			for _, f := range tc.forbidden {
				if strings.HasPrefix(dep, f) {
					t.Errorf("%s imports %s", tc.pkg, dep)
				}
			}
		}
	}
}
