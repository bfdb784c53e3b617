package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"

	"github.com/outbox-inbox/reference/internal/audit"
)

// auditResult is the loss audit's last report as the live view shows it:
// the report cmd/audit serves on /report, and whether the flow is whole
// (nothing missing, no phantom), as the audit judges it.
type auditResult struct {
	*audit.Report
	Whole bool `json:"whole"`
}

// errNoAuditYet: the audit has not completed its first run.
var errNoAuditYet = errors.New("no audit has completed yet")

// readAudit GETs the audit's /report.
func (v *liveView) readAudit(ctx context.Context, url string) (*auditResult, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := v.client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("not answering: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return nil, err
	}
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusServiceUnavailable:
		return nil, errNoAuditYet
	default:
		return nil, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return decodeAudit(body)
}

// decodeAudit decodes a /report body.
func decodeAudit(body []byte) (*auditResult, error) {
	var r audit.Report
	if err := json.Unmarshal(body, &r); err != nil {
		return nil, fmt.Errorf("decode the audit's report: %w", err)
	}
	if r.AuditedAt.IsZero() {
		return nil, errors.New("decode the audit's report: no audited_at")
	}
	return &auditResult{Report: &r, Whole: r.Whole()}, nil
}
