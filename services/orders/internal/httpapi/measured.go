package httpapi

import (
	"net/http"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/go-chi/chi/v5/middleware"
)

// RequestObserver records the requests the API answered (metrics.Requests).
type RequestObserver interface {
	// ObserveRequest records one request: its method (one of the standard
	// methods, or "_OTHER"), its route pattern ("unmatched" when no route
	// matched), the status it was answered with and how long that took.
	ObserveRequest(method, route string, status int, d time.Duration)
}

// unmatchedRoute labels the requests no route matched: their paths are
// the clients' to choose, and would make a series each.
const unmatchedRoute = "unmatched"

// measured is chi middleware: each request is observed once answered, by
// the route pattern chi matched, so that every route, the ones added later
// included, is measured without a list of them here.
func measured(obs RequestObserver) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			start := time.Now()
			ww := middleware.NewWrapResponseWriter(w, r.ProtoMajor)
			next.ServeHTTP(ww, r)
			route := unmatchedRoute
			if rc := chi.RouteContext(r.Context()); rc != nil {
				if p := rc.RoutePattern(); p != "" && p != "/*" {
					route = p
				}
			}
			status := ww.Status()
			if status == 0 {
				status = http.StatusOK // nothing written: net/http answers 200
			}
			obs.ObserveRequest(methodLabel(r.Method), route, status, time.Since(start))
		})
	}
}

// methodLabel returns method if it is a standard one, "_OTHER" otherwise
// (as OpenTelemetry's HTTP conventions do), so clients cannot make series.
func methodLabel(method string) string {
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch,
		http.MethodDelete, http.MethodOptions, http.MethodConnect, http.MethodTrace:
		return method
	}
	return "_OTHER"
}
