package chaos

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
)

// DefaultReportPath is where the suite writes its report when CHAOS_REPORT is
// unset, relative to the e2e package directory (go test's working directory).
const DefaultReportPath = "chaos-report.json"

// WriteReport writes r as indented JSON to path, creating its directory.
func WriteReport(path string, r Report) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return fmt.Errorf("encode chaos report: %w", err)
	}
	if dir := filepath.Dir(path); dir != "." {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("write chaos report: %w", err)
		}
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("write chaos report: %w", err)
	}
	return nil
}
