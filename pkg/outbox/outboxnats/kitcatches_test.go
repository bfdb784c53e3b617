package outboxnats_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// kitMutantEnv, in a child of TestTheKitCatchesAPublisherThatFailsDuplicates,
// makes TestPublisherConformance's publishers take a message published
// again for a failure: the bug that had a JetStream outbox dead-letter
// messages the stream held.
const kitMutantEnv = "OUTBOXNATS_KIT_MUTANT"

// failsDuplicates wraps a publisher and fails every message whose id it
// confirmed before.
type failsDuplicates struct {
	outbox.Publisher
	mu   sync.Mutex
	seen map[string]bool
}

func (f *failsDuplicates) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	f.mu.Lock()
	defer f.mu.Unlock()
	errs := f.Publisher.PublishBatch(ctx, msgs)
	for i, e := range msgs {
		if errs[i] == nil && f.seen[e.MessageID()] {
			errs[i] = errors.New("duplicate acknowledgement taken for a failure")
		}
		if errs[i] == nil {
			f.seen[e.MessageID()] = true
		}
	}
	return errs
}

// The kit fails a publisher that takes a duplicate acknowledgement for a
// failure (its Duplicate check), run in a child process.
func TestTheKitCatchesAPublisherThatFailsDuplicates(t *testing.T) {
	if os.Getenv(kitMutantEnv) != "" {
		t.Skip("in the mutant's child")
	}
	t.Parallel()
	cmd := exec.Command(os.Args[0], "-test.run", "^TestPublisherConformance$/^Duplicate$", "-test.count=1")
	cmd.Env = append(os.Environ(), kitMutantEnv+"=duplicate")
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Fatalf("the kit passed a publisher that fails duplicates:\n%s", out)
	}
	if !strings.Contains(string(out), "the same message published again") {
		t.Fatalf("the kit failed, but not on the duplicate (%v):\n%s", err, out)
	}
}
