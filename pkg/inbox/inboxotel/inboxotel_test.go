package inboxotel_test

import (
	"context"
	"errors"
	"slices"
	"testing"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"

	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/inbox/inboxotel"
	"github.com/outbox-inbox/reference/pkg/inbox/internal/inboxtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(inboxtest.Suite(m)) }

type fixture struct {
	rec     *tracetest.SpanRecorder
	tp      *sdktrace.TracerProvider
	tr      *inboxotel.Tracing
	in      *inbox.Inbox
	effects *mongo.Collection
}

func setup(t *testing.T, sampler sdktrace.Sampler) *fixture {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec), sdktrace.WithSampler(sampler))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	tr := inboxotel.New(tp)
	db := inboxtest.Database(t)
	in, err := inbox.New(db, inbox.Config{Consumer: "test", Mode: inbox.ModeStandalone, DoneCacheSize: -1, Hooks: tr.Hooks()})
	if err != nil {
		t.Fatal(err)
	}
	return &fixture{rec: rec, tp: tp, tr: tr, in: in, effects: db.Collection("effects")}
}

func (f *fixture) apply(msgID string) inbox.Handler {
	return func(ctx context.Context) error {
		_, err := f.effects.InsertOne(ctx, bson.D{{Key: "_id", Value: msgID}})
		if mongo.IsDuplicateKeyError(err) {
			return nil
		}
		return err
	}
}

// process runs Process for msgID under a span "process" of f's provider,
// with h traced as "effect", and returns the process span's context.
func (f *fixture) process(t *testing.T, ctx context.Context, msgID string, h inbox.Handler) (inbox.Result, error, trace.SpanContext) {
	t.Helper()
	ctx, span := f.tp.Tracer("test").Start(ctx, "process")
	defer span.End()
	res, err := f.in.Process(ctx, msgID, f.tr.Handler("effect", h, attribute.String("k", "v")))
	return res, err, span.SpanContext()
}

// children returns the names of parent's ended child spans, in start order,
// and the spans by name.
func (f *fixture) children(parent trace.SpanContext) ([]string, map[string]sdktrace.ReadOnlySpan) {
	var names []string
	byName := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range f.rec.Ended() {
		if s.Parent().SpanID() == parent.SpanID() && s.SpanContext().TraceID() == parent.TraceID() {
			names = append(names, s.Name())
			byName[s.Name()] = s
		}
	}
	return names, byName
}

func attr(s sdktrace.ReadOnlySpan, k attribute.Key) (attribute.Value, bool) {
	for _, kv := range s.Attributes() {
		if kv.Key == k {
			return kv.Value, true
		}
	}
	return attribute.Value{}, false
}

func TestCheckEffectAndRecordAreChildSpansAndADuplicateHasNoEffect(t *testing.T) {
	f := setup(t, sdktrace.AlwaysSample())
	ctx := t.Context()

	res, err, first := f.process(t, ctx, "m-1", f.apply("m-1"))
	if err != nil || res != inbox.Processed {
		t.Fatalf("Process: %v, %v", res, err)
	}
	names, spans := f.children(first)
	if got, want := names, []string{inboxotel.SpanCheck, "effect", inboxotel.SpanRecord}; !slices.Equal(got, want) {
		t.Fatalf("children of the first process span: %q, want %q", got, want)
	}
	if v, _ := attr(spans[inboxotel.SpanCheck], inboxotel.AttrDuplicate); v.AsBool() {
		t.Fatal("first delivery's check says duplicate")
	}
	if v, _ := attr(spans[inboxotel.SpanCheck], inboxotel.AttrMessageID); v.AsString() != "m-1" {
		t.Fatalf("check span's message id %q", v.AsString())
	}
	if v, _ := attr(spans["effect"], "k"); v.AsString() != "v" {
		t.Fatal("effect span lacks the caller's attribute")
	}

	res, err, second := f.process(t, ctx, "m-1", f.apply("m-1"))
	if err != nil || res != inbox.Duplicate {
		t.Fatalf("second Process: %v, %v", res, err)
	}
	names, spans = f.children(second)
	if got, want := names, []string{inboxotel.SpanCheck}; !slices.Equal(got, want) {
		t.Fatalf("children of the duplicate's process span: %q, want %q", got, want)
	}
	if v, ok := attr(spans[inboxotel.SpanCheck], inboxotel.AttrDuplicate); !ok || !v.AsBool() {
		t.Fatal("duplicate's check span lacks inbox.duplicate=true")
	}
}

func TestHandlerErrorSetsTheEffectSpansStatus(t *testing.T) {
	f := setup(t, sdktrace.AlwaysSample())
	boom := errors.New("boom")
	_, err, parent := f.process(t, t.Context(), "m-1", func(context.Context) error { return boom })
	if !errors.Is(err, boom) {
		t.Fatalf("Process: %v", err)
	}
	names, spans := f.children(parent)
	if got, want := names, []string{inboxotel.SpanCheck, "effect"}; !slices.Equal(got, want) {
		t.Fatalf("children: %q, want %q", got, want)
	}
	if st := spans["effect"].Status(); st.Code != codes.Error || st.Description != "boom" {
		t.Fatalf("effect span status %+v, want Error boom", st)
	}
}

func TestNothingIsStartedUnderAnUnsampledParent(t *testing.T) {
	f := setup(t, sdktrace.ParentBased(sdktrace.AlwaysSample()))
	tid, _ := trace.TraceIDFromHex("0af7651916cd43dd8448eb211c80319c")
	sid, _ := trace.SpanIDFromHex("b7ad6b7169203331")
	remote := trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, Remote: true}) // not sampled
	ctx := trace.ContextWithRemoteSpanContext(t.Context(), remote)
	var seen trace.SpanContext
	res, err, _ := f.process(t, ctx, "m-1", func(ctx context.Context) error {
		seen = trace.SpanContextFromContext(ctx)
		return nil
	})
	if err != nil || res != inbox.Processed {
		t.Fatalf("Process: %v, %v", res, err)
	}
	if n := len(f.rec.Started()); n != 0 {
		t.Fatalf("%d spans started under an unsampled parent", n)
	}
	if seen.TraceID() != tid || seen.IsSampled() {
		t.Fatalf("handler's span context %v: want trace %v, unsampled", seen, tid)
	}
}

func TestNilProviderTracesNothing(t *testing.T) {
	tr := inboxotel.New(nil)
	if h := tr.Hooks(); h.StartStep != nil || h.EndStep != nil {
		t.Fatal("hooks without a provider")
	}
	ran := false
	if err := tr.Handler("x", func(context.Context) error { ran = true; return nil })(t.Context()); err != nil || !ran {
		t.Fatalf("handler: ran %v, %v", ran, err)
	}
}
