"""The P4_16 syntax check: parse a .p4 file with the lark grammar ``p4_16.lark`` (written from the P4_16
specification's grammar appendix) and run the structural checks the open compiler would otherwise make:

- ``check_applies``: each table, and each control instance, is applied at most once on every path through a
  control's apply block (branches of an ``if`` or ``switch`` are separate paths; sequences add up);
- ``check_register_indexes``: every ``read``/``write`` (v1model ``register<T, I>``) or ``execute`` (TNA
  ``RegisterAction`` of a ``Register<T, I>``) index expression has exactly ``I``'s width, and every value of it
  fits the register's size: 2**width <= size, or, for a constant index, its value < size (widths resolved through
  casts, concatenations, slices, struct and header fields, parameters and typedefs; an index whose width cannot
  be resolved is an error, so the program keeps its indexes simple);
- ``check_constants``: the program's top-level ``const`` declarations equal the given Python values (the
  generator passes ``p4/layout.py``'s) and fit their declared widths.

The preprocessor is not P4: ``preprocess`` inlines local ``#include "file"`` (once each, which is what the include
guards mean), drops ``#ifndef``/``#define``/``#endif`` guard lines and v1model's ``#define V1MODEL_VERSION``, and
skips architecture includes
(``<core.p4>``, ``<v1model.p4>``, ``<tna.p4>``), whose type names are listed below instead. Any other directive
is an error. P4 tells type names from other identifiers in the lexer (p4c keeps a table of declared types); here a
scan of the declarations before the parse does the same, with one global scope.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedInput

GRAMMAR = Path(__file__).with_name("p4_16.lark")

# The type names the architecture files declare (p4lang/p4c p4include/core.p4 and v1model.p4; Intel's tna.p4 for
# the names the sketch in p4/tna/ uses). Only names matter to the parse.
ARCHITECTURE_TYPES = frozenset({
    "packet_in", "packet_out",  # core.p4
    "standard_metadata_t", "register", "counter", "direct_counter", "meter", "direct_meter", "action_profile",
    "action_selector", "CounterType", "MeterType", "HashAlgorithm", "CloneType", "V1Switch",  # v1model.p4
    "Register", "RegisterAction", "Random", "Hash", "Counter", "Meter", "Checksum", "Pipeline", "Switch",
    "MulticastGroupId_t", "PortId_t", "ingress_intrinsic_metadata_t", "ingress_intrinsic_metadata_from_parser_t",
    "ingress_intrinsic_metadata_for_deparser_t", "ingress_intrinsic_metadata_for_tm_t",
    "egress_intrinsic_metadata_t", "egress_intrinsic_metadata_from_parser_t",
    "egress_intrinsic_metadata_for_deparser_t", "egress_intrinsic_metadata_for_output_port_t",
    "HashAlgorithm_t", "CounterType_t", "MeterType_t", "MathUnit", "MathOp_t",  # tna.p4
})
ARCHITECTURE_INCLUDES = frozenset({"core.p4", "v1model.p4", "tna.p4"})

_INCLUDE = re.compile(r'#include\s+(?:"([^"]+)"|<([^>]+)>)\s*$')
_GUARD = re.compile(r"#define\s+(\w+)\s*$")  # an include guard's (the guard's #ifndef is a conditional below)
_CONDITIONAL = re.compile(r"#(ifdef|ifndef|else|endif)\b\s*(\w*)\s*$")
_ARCHITECTURE_VERSION = re.compile(r"#define\s+V1MODEL_VERSION\s+\d+\s*$")  # selects v1model.p4's API
_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_DECLARED_TYPE = re.compile(
    r"\b(?:header|header_union|struct|enum(?:\s+bit\s*<\s*\d+\s*>)?|parser|control|package)\s+([A-Za-z_]\w*)"
    r"|\bextern\s+([A-Za-z_]\w*)\s*(?:<[^>{;]*>)?\s*\{"
    r"|(?<![.\w])(?:typedef|type)\s[^;{=]*?([A-Za-z_]\w*)\s*;")
_TYPE_PARAMETERS = re.compile(r"\b[A-Za-z_]\w*\s*<\s*([A-Z]\w*(?:\s*,\s*[A-Z]\w*)*)\s*>\s*[({]")


class P4SyntaxError(ValueError):
    """A .p4 file that does not parse, with the file and line it happened at."""


class Source:
    """A .p4 file with its local includes inlined, and where each line of the result came from. ``defines``: the
    names ``-D`` defines; ``#ifdef`` / ``#ifndef`` / ``#else`` / ``#endif`` keep the lines they select (a file is
    inlined once, so an include guard's ``#ifndef`` always holds)."""

    def __init__(self, path: Path, defines: Iterable[str] = ()) -> None:
        self.lines: list[str] = []
        self.origin: list[tuple[Path, int]] = []
        self.defines = frozenset(defines)
        self._kept: list[bool] = []  # per open conditional: whether its lines are kept
        self._read(Path(path).resolve(), set())
        if self._kept:
            raise P4SyntaxError(f"{path}: {len(self._kept)} #if without #endif")

    def _read(self, path: Path, seen: set[Path]) -> None:
        if path in seen:
            return
        seen.add(path)
        for number, line in enumerate(path.read_text().splitlines(), 1):
            stripped = line.strip()
            conditional = _CONDITIONAL.match(stripped)
            if conditional:
                self._conditional(*conditional.groups(), f"{path}:{number}")
                line = ""
            elif not all(self._kept):
                line = ""  # left out by a conditional
            elif stripped.startswith("#"):
                include, guard = _INCLUDE.match(stripped), _GUARD.match(stripped)
                if include and include.group(1):
                    self._read((path.parent / include.group(1)).resolve(), seen)
                elif include and include.group(2) in ARCHITECTURE_INCLUDES:
                    pass
                elif not guard and not _ARCHITECTURE_VERSION.match(stripped):
                    raise P4SyntaxError(f"{path}:{number}: unsupported preprocessor line {stripped!r}")
                line = ""  # keeps the line numbers of what follows
            self.lines.append(line)
            self.origin.append((path, number))

    def _conditional(self, directive: str, name: str, where: str) -> None:
        if directive in ("ifdef", "ifndef"):
            self._kept.append((name in self.defines) == (directive == "ifdef"))
        elif not self._kept:
            raise P4SyntaxError(f"{where}: #{directive} without #if")
        elif directive == "else":
            self._kept[-1] = not self._kept[-1]
        else:
            self._kept.pop()

    @property
    def text(self) -> str:
        return "\n".join(self.lines) + "\n"

    def where(self, line: int) -> str:
        path, number = self.origin[min(line, len(self.origin)) - 1]
        return f"{path.name}:{number}"


def type_names(text: str) -> set[str]:
    """The type names a program declares (and the type parameters of its generic declarations)."""
    text = _COMMENTS.sub(" ", text)
    names = {name for match in _DECLARED_TYPE.finditer(text) for name in match.groups() if name}
    for match in _TYPE_PARAMETERS.finditer(text):
        names.update(part.strip() for part in match.group(1).split(","))
    return names


_TYPE_KEYWORDS = frozenset({"bit", "int", "varbit", "bool", "tuple", "string", "error", "void"})


class _TypeNames:
    """lark post-lexer doing what p4c's lexer does: an identifier that names a type becomes a TYPE_IDENTIFIER, and
    a `<` right after an identifier and before a type opens type arguments (L_ANGLE_ARGS: `b.lookahead<bit<8>>()`),
    not a comparison, which LALR(1) could not tell apart."""

    always_accept = ("IDENTIFIER",)

    def __init__(self) -> None:
        self.types: frozenset[str] = ARCHITECTURE_TYPES

    def process(self, stream: Iterator[Token]) -> Iterator[Token]:
        tokens = list(self._typed(stream))
        for i, token in enumerate(tokens):
            if (token.value == "<" and i and tokens[i - 1].type == "IDENTIFIER" and i + 1 < len(tokens)
                    and self._starts_type(tokens[i + 1], tokens[i + 2] if i + 2 < len(tokens) else None)):
                token.type = "L_ANGLE_ARGS"
            yield token

    def _typed(self, stream: Iterator[Token]) -> Iterator[Token]:
        previous = None
        for token in stream:
            # the name an extern object declares is not yet a type there (the spec's `EXTERN nonTypeName`); an
            # extern function's return type kept as an identifier parses as a type variable
            if token.type == "IDENTIFIER" and token.value in self.types and previous != "extern":
                token.type = "TYPE_IDENTIFIER"
            previous = token.value
            yield token

    @staticmethod
    def _starts_type(token: Token, after: Token | None) -> bool:
        if token.value in _TYPE_KEYWORDS or token.type == "DONTCARE":
            return True
        return token.type == "TYPE_IDENTIFIER" and (after is None or after.value != ".")  # not Enum.member


@functools.cache
def _parser() -> tuple[Lark, _TypeNames]:
    postlex = _TypeNames()
    return Lark(GRAMMAR.read_text(), parser="lalr", lexer="basic", postlex=postlex, propagate_positions=True), postlex


def parse_text(text: str, where=lambda line: f"line {line}") -> Tree:
    """The parse tree of P4_16 source text (no preprocessor lines); P4SyntaxError if it does not parse."""
    parser, postlex = _parser()
    postlex.types = ARCHITECTURE_TYPES | type_names(text)
    try:
        return parser.parse(text)
    except UnexpectedInput as error:
        context = error.get_context(text).rstrip()
        raise P4SyntaxError(f"{where(error.line)}: {type(error).__name__}\n{context}") from None


def parse(path: Path, defines: Iterable[str] = ()) -> Tree:
    """The parse tree of a .p4 file and the files it includes, as compiled with ``-D`` ``defines``."""
    source = Source(path, defines)
    return parse_text(source.text, source.where)


# ---- tree helpers

def _text(node) -> str:
    """The identifier a name-like node stands for ("apply" for the keyword used as a name, ...)."""
    if isinstance(node, Token):
        return node.value
    if node.data.endswith("_kw"):
        return node.data[:-3]
    return _text(node.children[0])


def _dotted(node) -> str | None:
    """"a.b.c" for a member chain of plain names, else None."""
    if isinstance(node, Token):
        return node.value if node.type in ("IDENTIFIER", "TYPE_IDENTIFIER") else None
    if node.data in ("ident", "prefixed_non_type_name", "non_type_name", "name", "type_name", "prefixed_type"):
        return _text(node)
    if node.data == "member":
        base = _dotted(node.children[0])
        return None if base is None else f"{base}.{_text(node.children[1])}"
    return None


def _calls(node) -> Iterator[tuple[str, list, Tree]]:
    """(dotted callee, argument nodes, the call node) of every call below node, in source order."""
    for sub in node.iter_subtrees_topdown():
        if sub.data in ("call", "method_call", "direct_application"):
            callee = sub.children[0] if sub.data != "direct_application" else None
            name = f"{_dotted(sub.children[0])}.apply" if callee is None else _dotted(callee)
            args = sub.children[-1]
            yield name, ([] if args is None else [a for a in args.children if a is not None]), sub


def _line(node) -> int:
    return getattr(node.meta, "line", 0) if isinstance(node, Tree) else node.line


def _declarations(tree: Tree, kind: str) -> Iterator[Tree]:
    return (sub for sub in tree.iter_subtrees_topdown() if sub.data == kind)


def _decl_name(node: Tree) -> str:
    """The declared name of a declaration node: its first `name` child."""
    for child in node.children:
        if isinstance(child, Tree) and child.data == "name":
            return _text(child)
        if isinstance(child, Tree) and child.data in ("control_type_declaration", "parser_type_declaration"):
            return _decl_name(child)
    raise ValueError(f"no name in {node.data}")


# ---- check 1: tables and control instances applied at most once per path

def _applies(node, applicable: set[str]) -> Counter:
    """The most times each applicable name is applied on one path through node."""
    if isinstance(node, Token) or node is None:
        return Counter()
    if node.data == "conditional_statement":
        condition, *branches = node.children
        return _applies(condition, applicable) + _max(_applies(b, applicable) for b in branches)
    if node.data == "switch_statement":
        expression, *cases = node.children
        return _applies(expression, applicable) + _max(_applies(c, applicable) for c in cases)
    uses = Counter()
    if node.data in ("call", "method_call", "direct_application"):
        name, _, _ = next(_calls(Tree("wrap", [node])))
        if name and name.endswith(".apply") and name[:-6] in applicable:
            uses[name[:-6]] += 1
    for child in node.children:
        uses += _applies(child, applicable)
    return uses


def _max(counters) -> Counter:
    out = Counter()
    for c in counters:
        out |= c
    return out


def check_applies(tree: Tree) -> list[str]:
    """Errors for each table or control instance applied twice on one path of a control's apply block."""
    controls = {_decl_name(c) for c in _declarations(tree, "control_declaration")}
    errors = []
    for control in _declarations(tree, "control_declaration"):
        locals_ = [c for c in control.children if isinstance(c, Tree)]
        applicable = {_decl_name(t) for t in locals_ if t.data == "table_declaration"}
        applicable |= {_decl_name(i) for i in locals_ if i.data == "instantiation" and _type_name(i) in controls}
        body = next(c for c in reversed(control.children) if isinstance(c, Tree) and c.data == "block_statement")
        for name, times in sorted(_applies(body, applicable).items()):
            if times > 1:
                errors.append(f"control {_decl_name(control)}: {name} is applied {times} times on one path")
    return errors


def _type_ref(node: Tree) -> Tree:
    return next(c for c in node.children if isinstance(c, Tree) and c.data != "annotations")


def _type_name(node: Tree) -> str:
    """The (outer) type name of an instantiation or declaration's type_ref."""
    type_ref = _type_ref(node)
    return _text(type_ref.children[0]) if type_ref.data == "specialized_type" else _text(type_ref)


# ---- check 2: register index widths

class _Types:
    """Widths of the program's types and constant values, for resolving index expressions."""

    def __init__(self, tree: Tree) -> None:
        self.fields: dict[str, dict[str, Tree]] = {}
        self.typedefs: dict[str, Tree] = {}
        self.constants: dict[str, int] = {}
        for kind in ("struct_type_declaration", "header_type_declaration", "header_union_declaration"):
            for decl in _declarations(tree, kind):
                self.fields[_decl_name(decl)] = dict(
                    _named(f) for f in decl.children if isinstance(f, Tree) and f.data == "struct_field")
        for decl in _declarations(tree, "typedef_declaration"):
            self.typedefs[_text(decl.children[-1])] = decl.children[-2]
        for decl in tree.children:
            if isinstance(decl, Tree) and decl.data == "constant_declaration":
                self.constants[_text(decl.children[-2])] = self.value(decl.children[-1])

    def resolve(self, type_ref) -> Tree | Token:
        while True:
            name = _dotted(type_ref)
            if name not in self.typedefs:
                return type_ref
            type_ref = self.typedefs[name]

    def width(self, type_ref) -> int | None:
        type_ref = self.resolve(type_ref)
        if isinstance(type_ref, Tree) and type_ref.data in ("bit_type", "int_type"):
            return int(type_ref.children[0].value)
        if isinstance(type_ref, Tree) and type_ref.data == "bit1_type":
            return 1
        return None

    def value(self, node) -> int:
        """A constant expression's value (integers, named constants, + - * << >> and parentheses)."""
        if node.data == "integer":
            return _integer(node.children[0].value)[0]
        if node.data == "ident":
            if _text(node) not in self.constants:
                raise ValueError(f"line {_line(node)}: {_text(node)} is not a declared constant")
            return self.constants[_text(node)]
        if node.data == "cast":
            return self.value(node.children[1])
        if node.data == "negate":
            return -self.value(node.children[0])
        if node.data in ("arith", "shl", "shr"):
            left, *op, right = node.children
            a, b = self.value(left), self.value(right)
            symbol = _text(op[0].children[0]) if op else ("<<" if node.data == "shl" else ">>")
            return {"+": a + b, "-": a - b, "*": a * b, "/": a // b, "%": a % b, "<<": a << b, ">>": a >> b}[symbol]
        raise ValueError(f"line {_line(node)}: not a constant expression ({node.data})")


def _integer(literal: str) -> tuple[int, int | None]:
    """(value, width or None) of a P4 integer literal such as 12, 0x1F, 8w255."""
    match = re.fullmatch(r"(?:(\d+)([ws]))?(.*)", literal.replace("_", ""))
    width, digits = match.group(1), match.group(3)
    base = {"0x": 16, "0b": 2, "0o": 8, "0d": 10}.get(digits[:2].lower(), 10)
    value = int(digits[2:] if base != 10 or digits[:2].lower() == "0d" else digits, base)
    return value, (int(width) if width else None)


def _named(node: Tree) -> tuple[str, Tree]:
    """(name, type) of a parameter, field or variable declaration: its `name` child and the type before it."""
    i = next(i for i, c in enumerate(node.children) if isinstance(c, Tree) and c.data == "name")
    return _text(node.children[i]), node.children[i - 1]


def _scope(params: list[Tree]) -> dict[str, Tree]:
    return dict(_named(p) for p in params)


def _parameters(node: Tree) -> list[Tree]:
    return [p for p in node.iter_subtrees_topdown() if p.data == "parameter"]


def _child(node: Tree, kind: str) -> Tree:
    return next(c for c in node.children if isinstance(c, Tree) and c.data == kind)


class _Widths:
    """Bit width of an expression inside one control (its parameters, locals and action parameters)."""

    def __init__(self, types: _Types, scope: dict[str, Tree]) -> None:
        self.types, self.scope = types, scope

    def of(self, node) -> int | None:
        data = node.data
        if data == "cast":
            return self.types.width(node.children[0])
        if data == "integer":
            return _integer(node.children[0].value)[1]
        if data == "concat":
            left, right = (self.of(c) for c in node.children)
            return None if left is None or right is None else left + right
        if data == "slice":
            return self.types.value(node.children[1]) - self.types.value(node.children[2]) + 1
        if data in ("arith", "bit_and", "bit_or", "bit_xor"):
            widths = {self.of(c) for c in node.children if isinstance(c, Tree) and c.data not in ("add_op", "mul_op")}
            return widths.pop() if len(widths) == 1 else None
        path = _dotted(node)
        if path is None:
            return None
        head, *fields = path.split(".")
        if head not in self.scope:
            return None
        type_ref = self.scope[head]
        for field in fields:
            struct = self.types.fields.get(_dotted(self.types.resolve(type_ref)) or "")
            if struct is None or field not in struct:
                return None
            type_ref = struct[field]
        return self.types.width(type_ref)


_INDEX_ARGUMENT = {"read": 1, "write": 0, "execute": 0}  # register.read(out value, index), write(index, value)


def check_register_indexes(tree: Tree) -> list[str]:
    """Errors for a register whose index type does not fit its size, or an index of another width."""
    types, errors = _Types(tree), []
    shared = _top_level(tree)
    for control in _declarations(tree, "control_declaration"):
        scope = _scope(_parameters(control.children[0]))
        registers: dict[str, tuple[int, int]] = {}  # name -> (index width, size)
        actions: dict[str, str] = {}  # TNA RegisterAction name -> its register
        for decl in [*shared, *control.children]:
            if not (isinstance(decl, Tree) and decl.data in ("instantiation", "variable_declaration")):
                continue
            if decl.data == "variable_declaration":
                scope.update([_named(decl)])
                continue
            kind, name = _type_name(decl), _decl_name(decl)
            type_ref, args = _type_ref(decl), [a for a in _child(decl, "argument_list").children if a is not None]
            if kind in ("register", "Register"):
                type_args = type_ref.children[1].children if type_ref.data == "specialized_type" else []
                width = types.width(type_args[1]) if len(type_args) == 2 else None
                if width is None:
                    errors.append(f"line {_line(decl)}: register {name} has no bit<W> index type")
                registers[name] = (width, types.value(args[0]))
            elif kind == "RegisterAction":
                actions[name] = _dotted(args[0])
        for action in (d for d in control.children if isinstance(d, Tree) and d.data == "action_declaration"):
            local = _Widths(types, scope | _scope(_parameters(action)))
            errors += _index_errors(action, registers, actions, local)
        errors += _index_errors(control.children[-1], registers, actions, _Widths(types, scope))
    return errors


def _index_errors(node: Tree, registers: dict, actions: dict, widths: _Widths) -> list[str]:
    widths = _Widths(widths.types, widths.scope | dict(_named(v) for v in _declarations(node, "variable_declaration")))
    errors = []
    for callee, args, call in _calls(node):
        target, _, method = (callee or "").rpartition(".")
        register = actions.get(target, target) if method == "execute" else target
        if register not in registers or method not in _INDEX_ARGUMENT or len(args) <= _INDEX_ARGUMENT[method]:
            continue
        index, (declared, size) = args[_INDEX_ARGUMENT[method]], registers[register]
        width = widths.of(index)
        if width != declared:
            found = "of unknown width" if width is None else f"bit<{width}>"
            errors.append(f"line {_line(call)}: {callee} index is {found}, the register's index type is "
                          f"bit<{declared}>")
        elif index.data == "integer" and widths.types.value(index) >= size:
            errors.append(f"line {_line(call)}: {callee} index {widths.types.value(index)} is beyond its {size} "
                          "entries")
        elif index.data != "integer" and 1 << width > size:
            errors.append(f"line {_line(call)}: {callee}: a bit<{width}> index can reach {(1 << width) - 1}, beyond "
                          f"its {size} entries")
    return errors


# ---- the program's tables, registers and control instances, for comparing with the Python layout

def tables(tree: Tree) -> dict[str, dict]:
    """Every table: name -> keys [(field, match kind)], actions [names], size, const entries (count) and the
    control that declares it."""
    types, out = _Types(tree), {}
    for control in _declarations(tree, "control_declaration"):
        for table in (c for c in control.children if isinstance(c, Tree) and c.data == "table_declaration"):
            info = {"keys": [], "actions": [], "size": None, "entries": 0, "control": _decl_name(control)}
            for prop in (p for p in table.children if isinstance(p, Tree)):
                if prop.data == "key_property":
                    info["keys"] = [(_dotted(k.children[0]), _text(k.children[1])) for k in prop.children]
                elif prop.data == "actions_property":
                    info["actions"] = [_text(_child(a, "name")) for a in prop.children]
                elif prop.data == "entries_property":
                    info["entries"] = len(prop.children)
                elif prop.data == "table_attribute" and _text(_child_token(prop)) == "size":
                    info["size"] = types.value(prop.children[-1])
            out[_decl_name(table)] = info
    return out


def _child_token(node: Tree) -> Token:
    return next(c for c in node.children if isinstance(c, Token) and c.type == "IDENTIFIER")


def _top_level(tree: Tree) -> list[Tree]:
    """The program's top-level instantiations (a register that ingress and egress share)."""
    return [decl for top in tree.children if isinstance(top, Tree)
            for decl in ([top] if top.data == "instantiation" else top.children)
            if isinstance(decl, Tree) and decl.data == "instantiation"]


def registers(tree: Tree) -> dict[str, dict]:
    """Every register: name -> value width, index width, size (cells) and the declaring control ("" at top
    level)."""
    types, out = _Types(tree), {}
    top = Tree("control_declaration", [Tree("name", [Token("NAME", "")]), *_top_level(tree)])
    for control in [top, *_declarations(tree, "control_declaration")]:
        for decl in (c for c in control.children if isinstance(c, Tree) and c.data == "instantiation"):
            type_ref = _type_ref(decl)
            if _type_name(decl) in ("register", "Register") and type_ref.data == "specialized_type":
                value, index = type_ref.children[1].children
                args = [a for a in _child(decl, "argument_list").children if a is not None]
                out[_decl_name(decl)] = {"width": types.width(value), "index": types.width(index),
                                         "size": types.value(args[0]),
                                         "control": _decl_name(control) if control is not top else ""}
    return out


def instances(tree: Tree) -> Counter:
    """How many instances of each control type the program declares (in controls, or as the package's arguments:
    ``V1Switch(IntmlParser(), ...)``)."""
    controls = {_decl_name(c) for c in _declarations(tree, "control_declaration")}
    declared = Counter(_type_name(i) for i in _declarations(tree, "instantiation") if _type_name(i) in controls)
    constructed = Counter(_text(c.children[0]) for c in _declarations(tree, "construct"))
    return declared + Counter({name: n for name, n in constructed.items() if name in controls})


# ---- check 3: constants equal the Python configuration

def constants(tree: Tree) -> dict[str, tuple[int, int | None]]:
    """Top-level constants: name -> (value, declared width or None)."""
    types = _Types(tree)
    return {_text(d.children[-2]): (types.constants[_text(d.children[-2])], types.width(d.children[-3]))
            for d in tree.children if isinstance(d, Tree) and d.data == "constant_declaration"}


def check_constants(tree: Tree, expected: Mapping[str, int]) -> list[str]:
    """Errors for each expected constant missing from the program, of another value, or wider than declared."""
    found, errors = constants(tree), []
    for name, value in expected.items():
        if name not in found:
            errors.append(f"const {name} is missing (expected {value})")
            continue
        actual, width = found[name]
        if actual != value:
            errors.append(f"const {name} = {actual}, the Python configuration says {value}")
        if width is not None and not 0 <= value < 1 << width:
            errors.append(f"const {name} = {value} does not fit bit<{width}>")
    return errors


def check(path: Path, expected: Mapping[str, int] | None = None) -> list[str]:
    """Parse a .p4 file (P4SyntaxError if it does not) and return the structural errors, none if it is sound."""
    tree = parse(path)
    return check_applies(tree) + check_register_indexes(tree) + check_constants(tree, expected or {})
