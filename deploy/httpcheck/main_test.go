package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestCheck(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/readyz" {
			_, _ = io.WriteString(w, "ok")
			return
		}
		http.Error(w, `{"error":"database unreachable"}`, http.StatusServiceUnavailable)
	}))
	defer srv.Close()

	tests := []struct {
		name    string
		args    []string
		wantErr string
	}{
		{"ready", []string{srv.URL + "/readyz"}, ""},
		{"not ready shows status and body", []string{srv.URL + "/other"}, "503 Service Unavailable: {\"error\":\"database unreachable\"}"},
		{"no url", nil, "usage"},
		{"two urls", []string{srv.URL, srv.URL}, "usage"},
		{"unreachable", []string{"http://127.0.0.1:1/readyz"}, "connection refused"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := run(tt.args, io.Discard)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("run(%q) = %v, want nil", tt.args, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("run(%q) = %v, want an error containing %q", tt.args, err, tt.wantErr)
			}
		})
	}
}
