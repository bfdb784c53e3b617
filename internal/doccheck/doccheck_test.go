package doccheck_test

import (
	"bytes"
	"net/url"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/outbox-inbox/reference/internal/doccheck"
)

// repo is the repository's root and the files git tracks there.
type repo struct {
	root  string
	files []string // slash-separated, relative to root
}

func trackedFiles(t *testing.T) repo {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("repository root %s: %v", root, err)
	}
	out, err := exec.Command("git", "-C", root, "ls-files", "-z").Output()
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("git ls-files: %v", err)
		}
		t.Skipf("git ls-files: %v (a checkout without git: nothing to list)", err)
	}
	var files []string
	for f := range strings.SplitSeq(strings.TrimRight(string(out), "\x00"), "\x00") {
		if f != "" {
			files = append(files, f)
		}
	}
	return repo{root: root, files: files}
}

func (r repo) read(t *testing.T, f string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(r.root, filepath.FromSlash(f)))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// markdown are the pages whose links are checked: the README and every page
// under docs/, subdirectories included.
func (r repo) markdown() []string {
	var md []string
	for _, f := range r.files {
		if f == "README.md" || (strings.HasPrefix(f, "docs/") && strings.HasSuffix(f, ".md")) {
			md = append(md, f)
		}
	}
	return md
}

// checkLink returns what is wrong with target, linked from the tracked file
// from, or "".
func (r repo) checkLink(t *testing.T, from, target string, anchors map[string]map[string]bool) string {
	if doccheck.External(target) {
		return ""
	}
	p, frag, _ := strings.Cut(target, "#")
	p, err := url.PathUnescape(p)
	if err != nil {
		return "bad escape: " + err.Error()
	}
	dest := from
	if p != "" {
		if path.IsAbs(p) {
			return "absolute path: GitHub resolves it against the site, not the repository"
		}
		dest = path.Clean(path.Join(path.Dir(from), p))
		if dest == ".." || strings.HasPrefix(dest, "../") {
			return "leaves the repository"
		}
		if _, err := os.Stat(filepath.Join(r.root, filepath.FromSlash(dest))); err != nil {
			return "no such file or directory: " + dest
		}
		if !r.tracked(dest) {
			return dest + " is not tracked by git: the link would break on GitHub"
		}
	}
	if frag == "" || !strings.HasSuffix(dest, ".md") {
		return ""
	}
	a, ok := anchors[dest]
	if !ok {
		a = doccheck.Anchors(r.read(t, dest))
		anchors[dest] = a
	}
	if !a[frag] {
		return "no heading with anchor #" + frag + " in " + dest
	}
	return ""
}

// tracked reports whether p is a tracked file or a directory holding one.
func (r repo) tracked(p string) bool {
	for _, f := range r.files {
		if f == p || strings.HasPrefix(f, p+"/") {
			return true
		}
	}
	return false
}

// Every relative link of the README and of docs/*.md names a file the
// repository tracks, and a heading that exists when it has a #fragment.
func TestMarkdownLinksResolve(t *testing.T) {
	r := trackedFiles(t)
	pages := r.markdown()
	if !slices.Contains(pages, "README.md") || len(pages) < 2 {
		t.Fatalf("found %v: want the README and docs/*.md", pages)
	}
	anchors := map[string]map[string]bool{}
	checked := 0
	for _, page := range pages {
		for _, l := range doccheck.Links(r.read(t, page)) {
			checked++
			if why := r.checkLink(t, page, l.Target, anchors); why != "" {
				t.Errorf("%s:%d: link %q: %s", page, l.Line, l.Target, why)
			}
		}
	}
	if checked < 50 {
		t.Errorf("checked %d links: the parser lost most of them", checked)
	}
}

// docsPath finds the docs/*.md paths Go comments, the Makefile and
// configuration files name, with their #fragment if any.
var docsPath = regexp.MustCompile(`(?:^|[^A-Za-z0-9_./-])(?:\.\./)*(docs/[A-Za-z0-9_-]+\.md)(?:#([A-Za-z0-9_-]+))?`)

// The docs/ pages that code, comments and configuration point to exist,
// and so do the headings they name.
func TestPathsToDocsInCodeExist(t *testing.T) {
	r := trackedFiles(t)
	anchors := map[string]map[string]bool{}
	checked := 0
	for _, f := range r.files {
		if !strings.HasSuffix(f, ".go") && !strings.HasSuffix(f, ".yml") && !strings.HasSuffix(f, ".sh") && path.Base(f) != "Makefile" {
			continue
		}
		text := r.read(t, f)
		for _, m := range docsPath.FindAllStringSubmatchIndex(text, -1) {
			checked++
			target := text[m[2]:m[3]]
			if m[4] >= 0 {
				target += "#" + text[m[4]:m[5]]
			}
			line := 1 + strings.Count(text[:m[0]], "\n")
			// Resolved from the root: comments name docs/ from there.
			if why := r.checkLink(t, "README.md", target, anchors); why != "" {
				t.Errorf("%s:%d: %s: %s", f, line, target, why)
			}
		}
	}
	if checked == 0 {
		t.Error("no docs/ path found in code: the pattern is broken")
	}
}

// checkedForWording are the files whose sentences are read: documentation,
// code and its comments, configuration. Third-party files under testdata/
// are not the repository's words.
func checkedForWording(f string) bool {
	if strings.Contains("/"+f, "/testdata/") {
		return false
	}
	switch path.Ext(f) {
	case ".md", ".go", ".yml", ".yaml", ".sh", ".sql", ".conf", ".env", ".html", ".js", ".json":
		return true
	}
	return path.Base(f) == "Makefile" || path.Base(f) == "Dockerfile"
}

// No tracked file talks about how the repository was made (doccheck.Forbidden
// lists the phrases): that history is in the commits.
func TestNoSentenceAboutHowTheRepositoryWasMade(t *testing.T) {
	r := trackedFiles(t)
	read := 0
	for _, f := range r.files {
		if !checkedForWording(f) {
			continue
		}
		text := r.read(t, f)
		if bytes.IndexByte([]byte(text), 0) >= 0 {
			continue // binary
		}
		read++
		for _, found := range doccheck.Find(text) {
			t.Errorf("%s:%d: %q: %s", f, found.Line, found.Text, found.Why)
		}
	}
	if read < 100 {
		t.Errorf("read %d files: want every tracked source and document", read)
	}
}

// The README stays a ten-minute read: the reference material lives in docs/.
func TestReadmeStaysShort(t *testing.T) {
	const maxLines, maxLine = 260, 300
	r := trackedFiles(t)
	lines := strings.Split(strings.TrimRight(r.read(t, "README.md"), "\n"), "\n")
	if len(lines) > maxLines {
		t.Errorf("README.md has %d lines, want at most %d: move reference material to docs/", len(lines), maxLines)
	}
	for i, l := range lines {
		if n := len([]rune(l)); n > maxLine {
			t.Errorf("README.md:%d is %d characters long, want at most %d", i+1, n, maxLine)
		}
	}
}

func TestSlugFollowsGitHub(t *testing.T) {
	for _, tc := range []struct{ heading, want string }{
		{"Running the tests", "running-the-tests"},
		{"The problem: a dual write", "the-problem-a-dual-write"},
		{"Delivery limit, prefetch and consumer_timeout (RabbitMQ 3.10)", "delivery-limit-prefetch-and-consumer_timeout-rabbitmq-310"},
		{"audit: the loss audit over 1,000,000 events", "audit-the-loss-audit-over-1000000-events"},
		{"1. The business transaction: services/orders/internal/postgres/store.go", "1-the-business-transaction-servicesordersinternalpostgresstorego"},
		{"What's left -- to try", "whats-left----to-try"},
		{"Größe und Äpfel", "größe-und-äpfel"},
	} {
		if got := doccheck.Slug(tc.heading); got != tc.want {
			t.Errorf("Slug(%q) = %q, want %q", tc.heading, got, tc.want)
		}
	}
}

func TestHeadingsTakeRenderedTextAndNumberDuplicates(t *testing.T) {
	md := "# Title\n\n## `RELAY_MODE` and [the relay](x.md)\n\n```\n## not a heading\n```\n\n## Tests\n### Tests\n## Tests ##\n#no space\n"
	var got []string
	for _, h := range doccheck.Headings(md) {
		got = append(got, h.Anchor)
	}
	want := []string{"title", "relay_mode-and-the-relay", "tests", "tests-1", "tests-2"}
	if !slices.Equal(got, want) {
		t.Errorf("anchors %q, want %q", got, want)
	}
}

func TestLinksOutsideCodeOnly(t *testing.T) {
	md := "See [a](a.md#x) and ![img](i.png \"title\").\n" +
		"`[not](code.md)` and\n```\n[nor](fence.md)\n```\n" +
		"[split\ntext](b.md) <https://example.com> [ext](https://example.com/y)\n" +
		"[ref]: <c.md>\n"
	var got []string
	for _, l := range doccheck.Links(md) {
		got = append(got, l.Target+"@"+strings.Repeat("|", l.Line))
	}
	want := []string{"a.md#x@|", "i.png@|", "b.md@||||||", "https://example.com/y@|||||||", "c.md@||||||||"}
	if !slices.Equal(got, want) {
		t.Errorf("links %q, want %q", got, want)
	}
	if !doccheck.External("https://example.com/y") || !doccheck.External("mailto:x@y") || doccheck.External("../README.md") {
		t.Error("External misjudges a scheme")
	}
}

// The wording check catches each phrase, across a line break inside a
// comment too, and leaves ordinary sentences alone.
func TestFindCatchesPhrasesAcrossCommentLines(t *testing.T) {
	// Each sentence is built from two halves, so that this file does not
	// itself contain the phrases it looks for.
	bad := []string{
		"It ran on the develop" + "ment machine.",
		"// ran on the develop" + "ment\n// machine, twice",
		"# added in this\n# rou" + "nd",
		"as the review" + "er asked",
		"2s on the machine this was bu" + "ilt on",
		"a machine without Docker (such as the one\n// this project is bu" + "ilt on)",
	}
	for _, text := range bad {
		if fs := doccheck.Find(text); len(fs) == 0 {
			t.Errorf("Find(%q) found nothing", text)
		}
	}
	if fs := doccheck.Find("// Line 1\n// line 2 of the round trip\n"); len(fs) != 0 {
		t.Errorf("Find flagged an ordinary comment: %v", fs)
	}
	fs := doccheck.Find("one\ntwo\nthe develop" + "ment machine\n")
	if len(fs) != 1 || fs[0].Line != 3 {
		t.Errorf("Find = %+v, want one finding on line 3", fs)
	}
}

// testName finds the test and benchmark functions a page names; a trailing
// * names every function with that prefix.
var testName = regexp.MustCompile(`\b((?:Test|Benchmark)[A-Z][A-Za-z0-9_]*)(\*?)`)

var testFunc = regexp.MustCompile(`(?m)^func ((?:Test|Benchmark)[A-Za-z0-9_]+)\(`)

// Every test the README and docs/ name as a proof exists, so a renamed or
// deleted test cannot leave a claim pointing at nothing.
func TestTestsNamedInDocsExist(t *testing.T) {
	r := trackedFiles(t)
	var funcs []string
	for _, f := range r.files {
		if strings.HasSuffix(f, "_test.go") {
			for _, m := range testFunc.FindAllStringSubmatch(r.read(t, f), -1) {
				funcs = append(funcs, m[1])
			}
		}
	}
	named := 0
	for _, page := range r.markdown() {
		text := r.read(t, page)
		for _, m := range testName.FindAllStringSubmatchIndex(text, -1) {
			name, prefix := text[m[2]:m[3]], m[5] > m[4]
			named++
			if !slices.ContainsFunc(funcs, func(f string) bool {
				return f == name || (prefix && strings.HasPrefix(f, name))
			}) {
				t.Errorf("%s:%d: %s names no test function of the repository", page, 1+strings.Count(text[:m[0]], "\n"), text[m[2]:m[5]])
			}
		}
	}
	if named < 20 {
		t.Errorf("found %d test names in the docs: the pattern is broken", named)
	}
}

// orderGuarantee is how the project states its order per aggregate: the
// package doc, the README and docs/guarantees.md each say it in these words,
// so none of them can promise more than the others.
const orderGuarantee = "the first copies of an aggregate's events reach the broker in version order unless a publish fails; " +
	"the events of a run behind a failed one go out again after it, so their last copies arrive after its; " +
	"a copy sent again (a lost confirm, a lease that ended mid-publish) can arrive after later events. " +
	"Every message carries its aggregate_version (1, 2, ... without gaps): a consumer that applies version v only after v-1, " +
	"and drops what it applied, sees each aggregate in order"

func TestOrderGuaranteeIsWordedTheSameEverywhere(t *testing.T) {
	r := trackedFiles(t)
	flat := func(s string) string {
		s = strings.ReplaceAll(s, "\n//", " ")
		return strings.Join(strings.Fields(s), " ")
	}
	for _, f := range []string{"pkg/outbox/doc.go", "pkg/outbox/outboxwal/doc.go", "README.md", "docs/guarantees.md"} {
		if !strings.Contains(flat(r.read(t, f)), orderGuarantee) {
			t.Errorf("%s does not state the order guarantee in the project's words: %q", f, orderGuarantee)
		}
	}
}

// index is the declarations of every Go file the repository tracks.
func (r repo) index(t *testing.T) *doccheck.Index {
	t.Helper()
	x := doccheck.NewIndex("github.com/outbox-inbox/reference")
	for _, f := range r.files {
		if strings.HasSuffix(f, ".go") && !strings.Contains("/"+f, "/testdata/") {
			if err := x.Add(f, r.read(t, f)); err != nil {
				t.Fatal(err)
			}
		}
	}
	return x
}

// Every Go name the tour cites is declared in a file its stop links to (or,
// qualified, in the package it names): a renamed function, or a name sent to
// the wrong file, fails here.
func TestTourNamesExist(t *testing.T) {
	r := trackedFiles(t)
	x := r.index(t)
	const tour = "docs/tour.md"
	checked := 0
	for _, sec := range doccheck.Sections(r.read(t, tour)) {
		var files []string
		for _, l := range sec.Links {
			p, _, _ := strings.Cut(l.Target, "#")
			if strings.HasSuffix(p, ".go") && !doccheck.External(p) {
				files = append(files, path.Clean(path.Join(path.Dir(tour), p)))
			}
		}
		for _, s := range sec.Spans {
			if !doccheck.IsGoName(s.Text) {
				continue
			}
			checked++
			if why := x.Resolve(s.Text, files); why != "" {
				t.Errorf("%s:%d: `%s` (section %q): %s", tour, s.Line, s.Text, sec.Heading, why)
			}
		}
	}
	if checked < 50 {
		t.Errorf("checked %d names in %s: the parser lost most of them", checked, tour)
	}
}

// Resolve fails on a name nobody declares, on a name sent to a file that
// does not declare it, and on a field path that breaks; it follows struct
// fields by type, qualified names into their package, and leaves names of
// third-party packages alone.
func TestResolveFailsOnWhatIsNotDeclared(t *testing.T) {
	x := doccheck.NewIndex("example.com/m")
	for f, src := range map[string]string{
		"a/a.go": "package a\nimport (\n\"github.com/jackc/pgx/v5\"\n\"example.com/m/b\"\n)\n" +
			"type Config struct{ Standalone StandaloneConfig; pgx.Tx }\ntype StandaloneConfig struct{ Lease int }\n" +
			"type Relay struct{}\nfunc (r *Relay) Run() {}\nconst budget = 1\nvar _ = b.X\n",
		"a/b.go": "package a\nfunc (r Relay) mark() {}\n",
		"b/b.go": "package b\nvar X = 1\n",
	} {
		if err := x.Add(f, src); err != nil {
			t.Fatal(err)
		}
	}
	here := []string{"a/a.go"}
	for _, ok := range []string{"Config", "Relay.Run", "Config.Standalone.Lease", "Config.Tx", "budget", "b.X", "pgx.Batch", "a.Relay.mark"} {
		if why := x.Resolve(ok, here); why != "" {
			t.Errorf("Resolve(%q) = %q, want it found", ok, why)
		}
	}
	for _, bad := range []string{"defaultTxBudget", "Relay.mark", "Relay.Stop", "Config.Standalone.Lapse", "Config.Lease.X", "b.Y", "c.Z"} {
		if why := x.Resolve(bad, here); why == "" {
			t.Errorf("Resolve(%q) found it, want a failure", bad)
		}
	}
	for span, want := range map[string]bool{
		"Relay.Run": true, "takeSlot": true, "outboxsql.UnblockNextSQL": true,
		"order.created": false, "blocked": false, "INSERT": false, "CRASH_POINT": false,
		"TestX": false, "FOR NO KEY UPDATE": false, "pkg/outbox": false,
	} {
		if got := doccheck.IsGoName(span); got != want {
			t.Errorf("IsGoName(%q) = %v, want %v", span, got, want)
		}
	}
}

// The README's Go code is the first code block of pkg/outbox's "Minimal use"
// and of pkg/inbox's "Use", and is compiled: snippets_test.go holds it
// verbatim, so an undefined name or an unchecked error there fails the build
// or go vet, and an edit of one copy alone fails here.
func TestReadmeCodeIsCompiled(t *testing.T) {
	r := trackedFiles(t)
	compiled := r.read(t, "internal/doccheck/snippets_test.go")
	blocks := doccheck.GoBlocks(r.read(t, "README.md"))
	docs := []struct{ file, heading string }{{"pkg/outbox/doc.go", "Minimal use"}, {"pkg/inbox/doc.go", "Use"}}
	if len(blocks) != len(docs) {
		t.Fatalf("README.md has %d go blocks, want %d: one per package doc of %v", len(blocks), len(docs), docs)
	}
	for i, d := range docs {
		if !strings.Contains(compiled, blocks[i]) {
			t.Errorf("README.md's go block %d is not in internal/doccheck/snippets_test.go, where it compiles:\n%s", i+1, blocks[i])
		}
		if got := doccheck.DocCodeBlock(r.read(t, d.file), d.heading); got != blocks[i] {
			t.Errorf("the first code block of %s's %q is not README.md's go block %d:\n%s", d.file, d.heading, i+1, got)
		}
	}
}

func TestDocCodeBlockTakesTheSectionsFirstBlock(t *testing.T) {
	src := "// Package p.\n//\n// # Other\n//\n//\tno()\n//\n// # Use\n//\n// Text.\n//\n//\tfunc f() {\n//\t\tg()\n//\n//\t\th()\n//\t}\n//\n// More.\n//\n//\tnot()\npackage p\n"
	if got, want := doccheck.DocCodeBlock(src, "Use"), "func f() {\n\tg()\n\n\th()\n}\n"; got != want {
		t.Errorf("DocCodeBlock = %q, want %q", got, want)
	}
	if got := doccheck.DocCodeBlock(src, "Missing"); got != "" {
		t.Errorf("DocCodeBlock of a missing section = %q", got)
	}
	md := "text\n```go\nx := 1\n```\n```sh\nls\n```\n~~~go\ny()\n~~~\n"
	if got := doccheck.GoBlocks(md); !slices.Equal(got, []string{"x := 1\n", "y()\n"}) {
		t.Errorf("GoBlocks = %q", got)
	}
}
