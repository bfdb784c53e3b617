package deadletter

import (
	"errors"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.mongodb.org/mongo-driver/v2/bson"
)

// Headers are a kept message's AMQP headers. Any AMQP header must survive
// MongoDB, and come back with its AMQP type when the message is
// re-published:
//
//   - an AMQP key may hold '.' or start with '$' ("tenant.id"), which
//     MongoDB refuses, or treats as an operator, as a field name;
//   - BSON has neither AMQP's integer widths nor its unsigned types, and a
//     timestamp, a byte string or a table read back from a BSON document is
//     a BSON type that no AMQP client sends.
//
// So they are stored as an array of {k, t, v} entries: the key as a string
// value, the AMQP type's name, and the value (a table's or an array's value
// is again an array of entries). Documents written before, with the headers
// as an embedded document, are still read.
type Headers map[string]any

// Names of the AMQP field types, as stored in an entry's t.
const (
	typeVoid      = "void"
	typeBool      = "bool"
	typeInt8      = "int8"
	typeUint8     = "uint8"
	typeInt16     = "int16"
	typeUint16    = "uint16"
	typeInt32     = "int32"
	typeUint32    = "uint32"
	typeInt64     = "int64"
	typeFloat32   = "float32"
	typeFloat64   = "float64"
	typeDecimal   = "decimal"
	typeString    = "string"
	typeBytes     = "bytes"
	typeTimestamp = "timestamp"
	typeArray     = "array"
	typeTable     = "table"
)

// entry is one stored header, or one element of an array (K unused).
type entry struct {
	K string        `bson:"k,omitempty"`
	T string        `bson:"t"`
	V bson.RawValue `bson:"v,omitempty"`
}

// MarshalBSONValue stores h as an array of entries.
func (h Headers) MarshalBSONValue() (byte, []byte, error) {
	arr, err := encodeTable(h)
	if err != nil {
		return 0, nil, err
	}
	t, data, err := bson.MarshalValue(arr)
	return byte(t), data, err
}

// UnmarshalBSONValue reads an array of entries, or an embedded document
// (headers stored before entries were).
func (h *Headers) UnmarshalBSONValue(typ byte, data []byte) error {
	raw := bson.RawValue{Type: bson.Type(typ), Value: data}
	switch raw.Type {
	case bson.TypeNull, bson.TypeUndefined:
		*h = nil
		return nil
	case bson.TypeArray:
		t, err := decodeTable(raw)
		if err != nil {
			return fmt.Errorf("deadletter: headers: %w", err)
		}
		*h = Headers(t)
		return nil
	case bson.TypeEmbeddedDocument:
		var d bson.D
		if err := raw.Unmarshal(&d); err != nil {
			return fmt.Errorf("deadletter: headers: %w", err)
		}
		*h = Headers(legacyTable(d))
		return nil
	default:
		return fmt.Errorf("deadletter: headers stored as BSON %v", raw.Type)
	}
}

func encodeTable(t map[string]any) (bson.A, error) {
	arr := make(bson.A, 0, len(t))
	for k, v := range t {
		e, err := encodeValue(v)
		if err != nil {
			return nil, fmt.Errorf("header %q: %w", k, err)
		}
		e = append(bson.D{{Key: "k", Value: k}}, e...)
		arr = append(arr, e)
	}
	return arr, nil
}

// encodeValue returns {t, v} for an AMQP field value, as amqp091-go
// decodes it or accepts it to publish.
func encodeValue(v any) (bson.D, error) {
	typed := func(t string, v any) (bson.D, error) { return bson.D{{Key: "t", Value: t}, {Key: "v", Value: v}}, nil }
	switch x := v.(type) {
	case nil:
		return bson.D{{Key: "t", Value: typeVoid}}, nil
	case bool:
		return typed(typeBool, x)
	case int8:
		return typed(typeInt8, int32(x))
	case uint8:
		return typed(typeUint8, int32(x))
	case int16:
		return typed(typeInt16, int32(x))
	case uint16:
		return typed(typeUint16, int32(x))
	case int32:
		return typed(typeInt32, x)
	case uint32:
		return typed(typeUint32, int64(x))
	case int64:
		return typed(typeInt64, x)
	case int:
		return typed(typeInt64, int64(x))
	case float32:
		return typed(typeFloat32, float64(x))
	case float64:
		return typed(typeFloat64, x)
	case amqp.Decimal:
		return typed(typeDecimal, bson.D{{Key: "scale", Value: int32(x.Scale)}, {Key: "value", Value: x.Value}})
	case string:
		return typed(typeString, x)
	case []byte:
		return typed(typeBytes, bson.Binary{Data: x})
	case time.Time:
		return typed(typeTimestamp, x.Unix()) // AMQP timestamps are in seconds
	case []any:
		arr := make(bson.A, 0, len(x))
		for i, e := range x {
			ev, err := encodeValue(e)
			if err != nil {
				return nil, fmt.Errorf("element %d: %w", i, err)
			}
			arr = append(arr, ev)
		}
		return typed(typeArray, arr)
	case amqp.Table:
		arr, err := encodeTable(x)
		if err != nil {
			return nil, err
		}
		return typed(typeTable, arr)
	case map[string]any:
		return encodeValue(amqp.Table(x))
	default:
		return nil, fmt.Errorf("%T is not an AMQP field value", v)
	}
}

func decodeTable(raw bson.RawValue) (amqp.Table, error) {
	var entries []entry
	if err := raw.Unmarshal(&entries); err != nil {
		return nil, err
	}
	t := make(amqp.Table, len(entries))
	for _, e := range entries {
		v, err := decodeValue(e)
		if err != nil {
			return nil, fmt.Errorf("header %q: %w", e.K, err)
		}
		t[e.K] = v
	}
	return t, nil
}

func decodeValue(e entry) (any, error) {
	if e.T == typeVoid {
		return nil, nil
	}
	switch e.T {
	case typeBool:
		b, ok := e.V.BooleanOK()
		return b, okOr(ok, e)
	case typeInt8:
		n, ok := e.V.Int32OK()
		return int8(n), okOr(ok, e)
	case typeUint8:
		n, ok := e.V.Int32OK()
		return uint8(n), okOr(ok, e)
	case typeInt16:
		n, ok := e.V.Int32OK()
		return int16(n), okOr(ok, e)
	case typeUint16:
		n, ok := e.V.Int32OK()
		return uint16(n), okOr(ok, e)
	case typeInt32:
		n, ok := e.V.Int32OK()
		return n, okOr(ok, e)
	case typeUint32:
		n, ok := e.V.Int64OK()
		return uint32(n), okOr(ok, e)
	case typeInt64:
		n, ok := e.V.Int64OK()
		return n, okOr(ok, e)
	case typeFloat32:
		f, ok := e.V.DoubleOK()
		return float32(f), okOr(ok, e)
	case typeFloat64:
		f, ok := e.V.DoubleOK()
		return f, okOr(ok, e)
	case typeDecimal:
		var d struct {
			Scale int32 `bson:"scale"`
			Value int32 `bson:"value"`
		}
		if err := e.V.Unmarshal(&d); err != nil {
			return nil, err
		}
		return amqp.Decimal{Scale: uint8(d.Scale), Value: d.Value}, nil
	case typeString:
		s, ok := e.V.StringValueOK()
		return s, okOr(ok, e)
	case typeBytes:
		_, b, ok := e.V.BinaryOK()
		return b, okOr(ok, e)
	case typeTimestamp:
		sec, ok := e.V.Int64OK()
		return time.Unix(sec, 0), okOr(ok, e)
	case typeArray:
		var elems []entry
		if err := e.V.Unmarshal(&elems); err != nil {
			return nil, err
		}
		out := make([]any, 0, len(elems))
		for i, el := range elems {
			v, err := decodeValue(el)
			if err != nil {
				return nil, fmt.Errorf("element %d: %w", i, err)
			}
			out = append(out, v)
		}
		return out, nil
	case typeTable:
		return decodeTable(e.V)
	default:
		return nil, fmt.Errorf("unknown type %q", e.T)
	}
}

func okOr(ok bool, e entry) error {
	if ok {
		return nil
	}
	return errors.New("type " + e.T + " stored as BSON " + e.V.Type.String())
}

// legacyTable converts headers stored as an embedded document to AMQP
// values, as far as BSON kept their types.
func legacyTable(d bson.D) amqp.Table {
	t := make(amqp.Table, len(d))
	for _, e := range d {
		if v, ok := legacyValue(e.Value); ok {
			t[e.Key] = v
		}
	}
	return t
}

func legacyValue(v any) (any, bool) {
	switch x := v.(type) {
	case nil, string, int64, int32, bool, float64:
		return x, true
	case bson.DateTime:
		return x.Time(), true
	case bson.Binary:
		return x.Data, true
	case bson.D:
		return legacyTable(x), true
	case bson.A:
		out := make([]any, 0, len(x))
		for _, e := range x {
			if v, ok := legacyValue(e); ok {
				out = append(out, v)
			}
		}
		return out, true
	}
	return nil, false
}
