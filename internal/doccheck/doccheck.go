// Package doccheck reads the repository's Markdown the way GitHub renders it,
// so that a test can walk every relative link of README.md and docs/*.md and
// fail on a missing file or heading anchor, and refuse sentences that tell
// how the repository was made rather than what it does. It also finds the
// Go code a page shows (GoBlocks, DocCodeBlock), so that a test can hold it
// to code that compiles, and the Go names a page cites (Sections, IsGoName),
// so that a test can resolve them against the repository's declarations
// (Index).
//
// It knows the subset of Markdown the repository uses: ATX headings (# to
// ######), inline links and images, reference definitions, fenced code
// blocks and code spans (whose contents are never links). External links
// (any URL scheme) are left alone: the test makes no network call.
package doccheck

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"unicode"
)

// Slug is the anchor GitHub gives a heading whose rendered text is text:
// lower case, every character that is not a letter, a digit, a space, a
// hyphen or an underscore dropped, each space turned into a hyphen.
func Slug(text string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(text) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_':
			b.WriteRune(r)
		case unicode.IsLetter(r) || unicode.IsDigit(r) || unicode.IsMark(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

var (
	atxHeading  = regexp.MustCompile(`^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$`)
	inlineLink  = regexp.MustCompile(`!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*(<[^>\n]*>|[^)\s]+)(?:\s+(?:"[^"]*"|'[^']*'|\([^)]*\)))?\s*\)`)
	refDef      = regexp.MustCompile(`(?m)^ {0,3}\[[^\]]+\]:\s*(<[^>\n]*>|\S+)`)
	htmlID      = regexp.MustCompile(`<[a-zA-Z][^>]*\s(?:id|name)="([^"]+)"`)
	fenceOpen   = regexp.MustCompile("^ {0,3}(`{3,}|~{3,})")
	emphasis    = strings.NewReplacer("`", "", "*", "")
	headingLink = regexp.MustCompile(`!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)`)
	htmlTag     = regexp.MustCompile(`</?[a-zA-Z][^>]*>`)
)

// blankCode returns md with the contents of fenced code blocks and code
// spans replaced by spaces, newlines kept, so offsets and line numbers stay
// those of md and nothing in code is taken for a link or a heading.
func blankCode(md string) string {
	out := []byte(md)
	blank := func(from, to int) {
		for i := from; i < to; i++ {
			if out[i] != '\n' {
				out[i] = ' '
			}
		}
	}
	// Fenced blocks, line by line.
	var fence string
	start := 0
	for start < len(md) {
		end := strings.IndexByte(md[start:], '\n')
		if end < 0 {
			end = len(md)
		} else {
			end += start
		}
		line := md[start:end]
		switch {
		case fence != "":
			blank(start, end)
			if t := strings.TrimSpace(line); strings.HasPrefix(t, fence) && strings.Trim(t, fence[:1]) == "" {
				fence = ""
			}
		default:
			if m := fenceOpen.FindStringSubmatch(line); m != nil {
				fence = m[1]
				blank(start, end)
			}
		}
		start = end + 1
	}
	// Code spans: a run of n backticks up to the next run of exactly n.
	s := string(out)
	for i := 0; i < len(s); {
		if s[i] != '`' {
			i++
			continue
		}
		n := 0
		for i+n < len(s) && s[i+n] == '`' {
			n++
		}
		closeAt := -1
		for j := i + n; j < len(s); {
			if s[j] != '`' {
				j++
				continue
			}
			m := 0
			for j+m < len(s) && s[j+m] == '`' {
				m++
			}
			if m == n {
				closeAt = j
				break
			}
			j += m
		}
		if closeAt < 0 {
			i += n
			continue
		}
		blank(i, closeAt+n)
		i = closeAt + n
	}
	return string(out)
}

// Heading is one ATX heading: its line and the anchor GitHub gives it.
type Heading struct {
	Line   int
	Text   string
	Anchor string
}

// Headings lists md's headings in order, with GitHub's anchors: a heading
// whose slug was already given gets -1, then -2, and so on.
func Headings(md string) []Heading {
	code := blankCode(md)
	seen := map[string]int{}
	var hs []Heading
	lines := strings.Split(md, "\n")
	codeLines := strings.Split(code, "\n")
	for i, line := range lines {
		if strings.TrimSpace(codeLines[i]) == "" && strings.TrimSpace(line) != "" {
			continue // inside a fenced block
		}
		m := atxHeading.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		text := headingLink.ReplaceAllString(m[2], "$1")
		text = htmlTag.ReplaceAllString(text, "")
		text = strings.TrimSpace(emphasis.Replace(text))
		hs = append(hs, Heading{Line: i + 1, Text: text, Anchor: unique(seen, Slug(text))})
	}
	return hs
}

// unique is github-slugger's rule for repeated slugs.
func unique(seen map[string]int, slug string) string {
	result := slug
	for {
		if _, taken := seen[result]; !taken {
			break
		}
		seen[slug]++
		result = slug + "-" + strconv.Itoa(seen[slug])
	}
	seen[result] = 0
	return result
}

// Anchors is the set of fragments a link into md may name: its headings'
// anchors and the id or name attributes of its HTML elements.
func Anchors(md string) map[string]bool {
	a := map[string]bool{}
	for _, h := range Headings(md) {
		a[h.Anchor] = true
	}
	for _, m := range htmlID.FindAllStringSubmatch(blankCode(md), -1) {
		a[m[1]] = true
	}
	return a
}

// Link is a link's destination and the line it starts on.
type Link struct {
	Line   int
	Target string
}

// Links lists the destinations of md's inline links, images and reference
// definitions, outside code.
func Links(md string) []Link {
	code := blankCode(md)
	var ls []Link
	add := func(at int, target string) {
		target = strings.TrimSuffix(strings.TrimPrefix(target, "<"), ">")
		ls = append(ls, Link{Line: 1 + strings.Count(code[:at], "\n"), Target: target})
	}
	for _, m := range inlineLink.FindAllStringSubmatchIndex(code, -1) {
		add(m[0], code[m[4]:m[5]])
	}
	for _, m := range refDef.FindAllStringSubmatchIndex(code, -1) {
		add(m[0], code[m[2]:m[3]])
	}
	return ls
}

var scheme = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9+.-]*:`)

// External reports whether target leaves the repository: a URL with a
// scheme (https:, mailto:) or a protocol-relative one.
func External(target string) bool {
	return scheme.MatchString(target) || strings.HasPrefix(target, "//")
}

// Phrase is a kind of sentence the repository does not contain, and why.
type Phrase struct {
	Pattern *regexp.Regexp
	Why     string
}

// Forbidden are sentences about how the repository was made, which belong in
// commit messages: the docs and comments say what the code does and what was
// verified (docs/verification.md), not who looked at it or where it was
// written.
var Forbidden = []Phrase{
	{regexp.MustCompile(`(?i)\bthis\s+round\b`), "a round of work is the history of a change: say it in the commit message"},
	{regexp.MustCompile(`(?i)\bdev(elopment)?\s+machine\b`), "say what ran where in docs/verification.md, with its date and commit"},
	{regexp.MustCompile(`(?i)\bthe\s+reviewers?\b`), "a review is the history of a change: say it in the commit message"},
	{regexp.MustCompile(`(?i)\bmachine\s+(this|it)\s+was\s+built\s+on\b`), "say what ran where in docs/verification.md, with its date and commit"},
	{regexp.MustCompile(`(?i)\bthis\s+project\s+is\s+built\s+on\b`), "say what ran where in docs/verification.md, with its date and commit"},
}

// commentBreak joins lines so that a phrase split by a line break, inside a
// comment (//, #) or not, is still one phrase.
var commentBreak = regexp.MustCompile(`[ \t]*\r?\n[ \t]*(?://+|#+)?[ \t]*`)

// Find returns, for each forbidden phrase in text, the line it starts on
// and the words matched.
func Find(text string) []Found {
	// Map offsets in the joined text back to lines.
	var lineAt []int
	var joined strings.Builder
	line := 1
	last := 0
	for _, m := range commentBreak.FindAllStringIndex(text, -1) {
		for i := last; i < m[0]; i++ {
			joined.WriteByte(text[i])
			lineAt = append(lineAt, line)
		}
		joined.WriteByte(' ')
		lineAt = append(lineAt, line)
		line++
		last = m[1]
	}
	for i := last; i < len(text); i++ {
		joined.WriteByte(text[i])
		lineAt = append(lineAt, line)
	}
	j := joined.String()
	var fs []Found
	for _, p := range Forbidden {
		for _, m := range p.Pattern.FindAllStringIndex(j, -1) {
			fs = append(fs, Found{Line: lineAt[m[0]], Text: j[m[0]:m[1]], Why: p.Why})
		}
	}
	return fs
}

// Found is one forbidden phrase in a file.
type Found struct {
	Line int
	Text string
	Why  string
}

// GoBlocks returns the contents of md's fenced code blocks tagged go, in
// order, each without its fences and ending in a newline.
func GoBlocks(md string) []string {
	var blocks []string
	var b strings.Builder
	fence := ""
	for line := range strings.SplitSeq(md, "\n") {
		t := strings.TrimSpace(line)
		switch {
		case fence == "" && (t == "```go" || t == "~~~go"):
			fence = t[:3]
			b.Reset()
		case fence != "" && t == fence:
			blocks = append(blocks, b.String())
			fence = ""
		case fence != "":
			b.WriteString(line)
			b.WriteByte('\n')
		}
	}
	return blocks
}

// DocCodeBlock returns the first code block of the section titled heading
// ("// # heading") in the doc comment of the Go file src, unindented by one
// tab, ending in a newline, or "" when there is none.
func DocCodeBlock(src, heading string) string {
	lines := strings.Split(src, "\n")
	i := slices.Index(lines, "// # "+heading)
	if i < 0 {
		return ""
	}
	var b strings.Builder
	blank := 0 // blank comment lines seen inside the block, not yet written
	in := false
	for _, l := range lines[i+1:] {
		switch {
		case strings.HasPrefix(l, "//\t"):
			in = true
			b.WriteString(strings.Repeat("\n", blank))
			blank = 0
			b.WriteString(l[len("//\t"):])
			b.WriteByte('\n')
		case l == "//" && in:
			blank++
		case in || strings.HasPrefix(l, "// #") || !strings.HasPrefix(l, "//"):
			return b.String()
		}
	}
	return b.String()
}

// Span is a code span of a Markdown page: its text and the line it is on.
type Span struct {
	Line int
	Text string
}

// Section is the part of a Markdown page under one "## " heading (the part
// before the first is the section with an empty Heading).
type Section struct {
	Heading string
	Spans   []Span
	Links   []Link
}

// Sections splits md at its "## " headings and lists the code spans and the
// links of each, outside fenced blocks.
func Sections(md string) []Section {
	code := blankCode(md)
	secs := []Section{{}}
	lines := strings.Split(md, "\n")
	codeLines := strings.Split(code, "\n")
	links := Links(md)
	for i, line := range lines {
		fenced := strings.TrimSpace(codeLines[i]) == "" && strings.TrimSpace(line) != ""
		if !fenced && strings.HasPrefix(line, "## ") {
			secs = append(secs, Section{Heading: strings.TrimSpace(line[3:])})
		}
		s := &secs[len(secs)-1]
		for _, l := range links {
			if l.Line == i+1 {
				s.Links = append(s.Links, l)
			}
		}
		if fenced {
			continue
		}
		for _, m := range codeSpan.FindAllStringSubmatch(line, -1) {
			s.Spans = append(s.Spans, Span{Line: i + 1, Text: m[1]})
		}
	}
	return secs
}

var codeSpan = regexp.MustCompile("`([^`\n]+)`")

// goName is a code span that names Go: an identifier, or identifiers joined
// by dots (pkg.Name, Type.Method, Type.Field.Field).
var goName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*$`)

// IsGoName reports whether a code span is one that Index.Resolve checks: a
// dotted name with an upper-case letter (not an event type such as
// order.created), or an identifier in mixed case. All-lower-case words
// (columns, states) and all-upper-case ones (SQL, environment variables) are
// not Go names, and test functions are checked against the tests instead.
func IsGoName(s string) bool {
	if !goName.MatchString(s) || strings.HasPrefix(s, "Test") || strings.HasPrefix(s, "Benchmark") {
		return false
	}
	return strings.ContainsFunc(s, unicode.IsUpper) && strings.ContainsFunc(s, unicode.IsLower)
}

// Index holds the names the Go files of a repository declare: functions,
// types, constants and variables by name, methods (interface methods too)
// and struct fields as Type.Name, per file and per package name.
type Index struct {
	byFile    map[string]map[string]bool
	byPkg     map[string]map[string]bool
	fieldType map[string]string // package "\x00" Type.Field -> the field's named type
	pkgOf     map[string]string // file -> package name
	imported  map[string]bool   // names third-party packages are imported under
	module    string
}

// NewIndex starts an empty index of the module named module.
func NewIndex(module string) *Index {
	return &Index{
		byFile: map[string]map[string]bool{}, byPkg: map[string]map[string]bool{},
		fieldType: map[string]string{}, pkgOf: map[string]string{}, imported: map[string]bool{},
		module: module,
	}
}

// Add indexes the declarations of the Go file named file, whose source is src.
func (x *Index) Add(file, src string) error {
	f, err := parser.ParseFile(token.NewFileSet(), file, src, parser.SkipObjectResolution)
	if err != nil {
		return err
	}
	pkg := f.Name.Name
	x.pkgOf[file] = pkg
	add := func(name string) {
		if x.byFile[file] == nil {
			x.byFile[file] = map[string]bool{}
		}
		if x.byPkg[pkg] == nil {
			x.byPkg[pkg] = map[string]bool{}
		}
		x.byFile[file][name] = true
		x.byPkg[pkg][name] = true
	}
	for _, imp := range f.Imports {
		p, _ := strconv.Unquote(imp.Path.Value)
		if p == x.module || strings.HasPrefix(p, x.module+"/") {
			continue
		}
		name := path.Base(p)
		if majorVersion.MatchString(name) {
			name = path.Base(path.Dir(p))
		}
		if imp.Name != nil {
			name = imp.Name.Name
		}
		x.imported[name] = true
	}
	for _, d := range f.Decls {
		switch d := d.(type) {
		case *ast.FuncDecl:
			if d.Recv == nil {
				add(d.Name.Name)
				continue
			}
			add(typeName(d.Recv.List[0].Type) + "." + d.Name.Name)
		case *ast.GenDecl:
			for _, s := range d.Specs {
				switch s := s.(type) {
				case *ast.ValueSpec:
					for _, n := range s.Names {
						add(n.Name)
					}
				case *ast.TypeSpec:
					add(s.Name.Name)
					if it, ok := s.Type.(*ast.InterfaceType); ok {
						for _, m := range it.Methods.List {
							for _, n := range m.Names {
								add(s.Name.Name + "." + n.Name)
							}
						}
					}
					st, ok := s.Type.(*ast.StructType)
					if !ok {
						continue
					}
					for _, fl := range st.Fields.List {
						names := fl.Names
						if len(names) == 0 { // embedded
							names = []*ast.Ident{{Name: typeName(fl.Type)}}
						}
						for _, n := range names {
							add(s.Name.Name + "." + n.Name)
							x.fieldType[pkg+"\x00"+s.Name.Name+"."+n.Name] = typeName(fl.Type)
						}
					}
				}
			}
		}
	}
	return nil
}

// majorVersion is the last element of an import path like pgx/v5.
var majorVersion = regexp.MustCompile(`^v[0-9]+$`)

// typeName is the name of a named type, through pointers, type arguments
// and package qualifiers: *Relay[T] and *pkg.Relay are Relay.
func typeName(e ast.Expr) string {
	for {
		switch t := e.(type) {
		case *ast.StarExpr:
			e = t.X
		case *ast.IndexExpr:
			e = t.X
		case *ast.IndexListExpr:
			e = t.X
		case *ast.SelectorExpr:
			return t.Sel.Name
		case *ast.Ident:
			return t.Name
		default:
			return ""
		}
	}
}

// Resolve reports whether name is declared where a reader is sent to look:
// an unqualified name (Enqueue, Relay.Run, Config.Standalone.Lease) in one
// of files, a name qualified by a package of the repository (outbox.Writer)
// in that package. A name qualified by a third-party package the repository
// imports (pgx.Tx) is not checked. It returns "" or what is wrong.
func (x *Index) Resolve(name string, files []string) string {
	parts := strings.Split(name, ".")
	for _, f := range files {
		if x.declares(x.pkgOf[f], x.byFile[f], parts) {
			return ""
		}
	}
	if len(parts) > 1 {
		if decls, ok := x.byPkg[parts[0]]; ok {
			if x.declares(parts[0], decls, parts[1:]) {
				return ""
			}
			return "package " + parts[0] + " declares no " + strings.Join(parts[1:], ".")
		}
		if x.imported[parts[0]] {
			return ""
		}
	}
	if len(files) == 0 {
		return "no Go file is linked here to declare it"
	}
	return "not declared in " + strings.Join(files, ", ")
}

// declares reports whether decls, of package pkg, declare the dotted name
// parts, following struct fields by their types (Config.Standalone.Lease).
func (x *Index) declares(pkg string, decls map[string]bool, parts []string) bool {
	if len(parts) <= 2 {
		return decls[strings.Join(parts, ".")]
	}
	key := parts[0] + "." + parts[1]
	t, ok := x.fieldType[pkg+"\x00"+key]
	if !decls[key] || !ok {
		return false
	}
	return x.declares(pkg, x.byPkg[pkg], append([]string{t}, parts[2:]...))
}
