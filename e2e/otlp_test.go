package e2e

import (
	"compress/gzip"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"

	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"
)

// recordedSpan is one span an OTLP exporter sent, flattened.
type recordedSpan struct {
	Service  string // the resource's service.name
	Instance string // the resource's service.instance.id
	Version  string // the resource's service.version
	Name     string
	Kind     tracepb.Span_SpanKind
	TraceID  string // hex
	SpanID   string
	ParentID string // "" for a root
	Status   tracepb.Status_StatusCode
	Attrs    map[string]any
	Links    []string // "traceid/spanid" of each link
}

// linksTo reports whether s links to span o.
func (s recordedSpan) linksTo(o recordedSpan) bool {
	for _, l := range s.Links {
		if l == o.TraceID+"/"+o.SpanID {
			return true
		}
	}
	return false
}

func (s recordedSpan) String() string {
	return fmt.Sprintf("%s:%q %s/%s<-%s", s.Service, s.Name, s.TraceID[:8], s.SpanID, s.ParentID)
}

// otlpReceiver is an OTLP/HTTP trace receiver (POST /v1/traces, protobuf,
// optionally gzipped): what a collector or Jaeger is to the services.
type otlpReceiver struct {
	srv *http.Server
	ln  net.Listener

	mu    sync.Mutex
	spans []recordedSpan
	errs  []error
}

func startOTLPReceiver() (*otlpReceiver, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("otlp receiver: %w", err)
	}
	r := &otlpReceiver{ln: ln}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/traces", r.export)
	r.srv = &http.Server{Handler: mux}
	go func() { _ = r.srv.Serve(ln) }()
	return r, nil
}

// endpoint is the value of OTEL_EXPORTER_OTLP_ENDPOINT for the services.
func (r *otlpReceiver) endpoint() string { return "http://" + r.ln.Addr().String() }

func (r *otlpReceiver) close() error { return r.srv.Close() }

func (r *otlpReceiver) fail(w http.ResponseWriter, err error) {
	r.mu.Lock()
	r.errs = append(r.errs, err)
	r.mu.Unlock()
	http.Error(w, err.Error(), http.StatusBadRequest)
}

func (r *otlpReceiver) export(w http.ResponseWriter, req *http.Request) {
	var body io.Reader = req.Body
	if req.Header.Get("Content-Encoding") == "gzip" {
		gz, err := gzip.NewReader(req.Body)
		if err != nil {
			r.fail(w, fmt.Errorf("gzip: %w", err))
			return
		}
		defer gz.Close()
		body = gz
	}
	raw, err := io.ReadAll(body)
	if err != nil {
		r.fail(w, fmt.Errorf("read: %w", err))
		return
	}
	if ct := req.Header.Get("Content-Type"); ct != "application/x-protobuf" {
		r.fail(w, fmt.Errorf("content type %q, want application/x-protobuf", ct))
		return
	}
	var msg collectortrace.ExportTraceServiceRequest
	if err := proto.Unmarshal(raw, &msg); err != nil {
		r.fail(w, fmt.Errorf("decode ExportTraceServiceRequest: %w", err))
		return
	}
	var got []recordedSpan
	for _, rs := range msg.GetResourceSpans() {
		res := attrMap(rs.GetResource().GetAttributes())
		service, instance, version := res["service.name"], res["service.instance.id"], res["service.version"]
		for _, ss := range rs.GetScopeSpans() {
			for _, s := range ss.GetSpans() {
				var links []string
				for _, l := range s.GetLinks() {
					links = append(links, hex.EncodeToString(l.GetTraceId())+"/"+hex.EncodeToString(l.GetSpanId()))
				}
				got = append(got, recordedSpan{
					Service: fmt.Sprint(service), Instance: fmt.Sprint(instance), Version: fmt.Sprint(version), Links: links,
					Name: s.GetName(), Kind: s.GetKind(),
					TraceID: hex.EncodeToString(s.GetTraceId()), SpanID: hex.EncodeToString(s.GetSpanId()),
					ParentID: hex.EncodeToString(s.GetParentSpanId()), Status: s.GetStatus().GetCode(),
					Attrs: attrMap(s.GetAttributes()),
				})
			}
		}
	}
	r.mu.Lock()
	r.spans = append(r.spans, got...)
	r.mu.Unlock()
	out, _ := proto.Marshal(&collectortrace.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(out)
}

// trace returns the spans received so far of traceID.
func (r *otlpReceiver) trace(traceID string) []recordedSpan {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []recordedSpan
	for _, s := range r.spans {
		if s.TraceID == traceID {
			out = append(out, s)
		}
	}
	return out
}

func (r *otlpReceiver) problems() []error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]error(nil), r.errs...)
}

func attrMap(kvs []*commonpb.KeyValue) map[string]any {
	m := make(map[string]any, len(kvs))
	for _, kv := range kvs {
		switch v := kv.GetValue().GetValue().(type) {
		case *commonpb.AnyValue_StringValue:
			m[kv.GetKey()] = v.StringValue
		case *commonpb.AnyValue_IntValue:
			m[kv.GetKey()] = v.IntValue
		case *commonpb.AnyValue_BoolValue:
			m[kv.GetKey()] = v.BoolValue
		case *commonpb.AnyValue_DoubleValue:
			m[kv.GetKey()] = v.DoubleValue
		default:
			m[kv.GetKey()] = kv.GetValue().String()
		}
	}
	return m
}
