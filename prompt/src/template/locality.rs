//! Which chat templates render each message on its own, decided from the template's syntax tree
//! (minijinja's parser), and the rewrite that lets a follow-up turn render only its new messages.
//!
//! # The class
//!
//! A template is *message-local* when it is one top-level `{% for NAME in messages %}` loop
//! (no filter, not recursive, no `else`) between statements that never mention `messages`, and
//! the loop body only emits, branches (`if`) and `continue`s, reading nothing but `NAME`,
//! `loop.index` / `loop.index0` / `loop.first`, and names the template never assigns (its
//! inputs: special tokens, `add_generation_prompt`, `tools`, the request's template kwargs), and
//! calling nothing but methods, filters, tests and `raise_exception`. Then the text a message
//! renders to is a function of that message, its index and the inputs alone: not of the
//! messages after it (`loop.last`, `loop.length`, `messages | length` are refused), nor of state
//! carried between iterations (`set`, namespaces, `loop.previtem`, `break` are refused), nor of
//! the clock (`strftime_now` is refused). The statements around the loop read no message, so
//! their text is a function of the inputs. Templates outside the class (most real ones look at
//! `messages[0]` for a system prompt, or carry a namespace) are rendered whole every time.
//!
//! # The rewrite
//!
//! The loop is wrapped so that one render marks where the loop's text starts and ends and skips
//! the first `__continuum_from` iterations; the tags inserted copy the whitespace-control
//! markers of the tags they touch, so the text outside the marks is byte for byte the original
//! template's (the property tests compare the two). A follow-up whose first `k` messages and
//! inputs equal a cached turn's then renders `k` empty iterations and the new messages' bodies,
//! and its text is the cached turn's text up to its loop end, then the new bodies, then the
//! statements after the loop rendered anew.

use minijinja::machinery::ast::{CallArg, Expr, ForLoop, Stmt};
use minijinja::syntax::SyntaxConfig;

/// Template variable: iterations before this index are skipped.
pub(crate) const FROM_VAR: &str = "__continuum_from";
/// Template variables holding the marks around the loop's text.
pub(crate) const START_VAR: &str = "__continuum_start";
pub(crate) const END_VAR: &str = "__continuum_end";

/// The names a template never assigns are its inputs; these are what a local body may read
/// besides the loop variable and the loop's index.
const LOOP_ATTRS: [&str; 3] = ["index", "index0", "first"];
/// Functions a local body may call: pure, or failing (the failure is the render's).
const CALLABLE: [&str; 1] = ["raise_exception"];

/// The rewritten source of a message-local template, or why the template is not one.
pub(crate) fn rewrite(source: &str, syntax: SyntaxConfig) -> Result<String, &'static str> {
    let ast = minijinja::machinery::parse(source, "chat_template", syntax)
        .map_err(|_| "does not parse")?;
    let Stmt::Template(template) = &ast else {
        return Err("not a template");
    };
    let mut assigned = Vec::new();
    for stmt in &template.children {
        assigned_names(stmt, &mut assigned);
    }
    let mut the_loop = None;
    for stmt in &template.children {
        let over_messages = |l: &ForLoop<'_>| matches!(&l.iter, Expr::Var(v) if v.id == "messages");
        if let Stmt::ForLoop(l) = stmt
            && over_messages(l)
        {
            if the_loop.replace(l).is_some() {
                return Err("two loops over messages");
            }
        } else if stmt_mentions(stmt, "messages") {
            return Err("messages is read outside the loop");
        }
    }
    let the_loop = the_loop.ok_or("no loop over messages")?;
    let Expr::Var(target) = &the_loop.target else {
        return Err("the loop unpacks its item");
    };
    if the_loop.filter_expr.is_some() || the_loop.recursive || !the_loop.else_body.is_empty() {
        return Err("the loop has a filter, recursion or an else");
    }
    if target.id == "loop" || assigned.iter().any(|a| *a == "loop" || *a == "messages") {
        return Err("loop or messages is assigned");
    }
    let body = Body {
        target: target.id,
        assigned: &assigned,
    };
    for stmt in &the_loop.body {
        body.stmt(stmt)?;
    }
    let span = the_loop.span();
    splice(
        source,
        span.start_offset as usize,
        span.end_offset as usize,
        target.id,
    )
}

/// Every name a statement (or one nested in it) assigns.
fn assigned_names<'a>(stmt: &Stmt<'a>, out: &mut Vec<&'a str>) {
    let target = |expr: &Expr<'a>, out: &mut Vec<&'a str>| match expr {
        Expr::Var(v) => out.push(v.id),
        Expr::List(l) => l.items.iter().for_each(|e| {
            if let Expr::Var(v) = e {
                out.push(v.id);
            }
        }),
        Expr::Tuple(t) => t.items.iter().for_each(|e| {
            if let Expr::Var(v) = e {
                out.push(v.id);
            }
        }),
        _ => {}
    };
    match stmt {
        Stmt::Template(t) => t.children.iter().for_each(|s| assigned_names(s, out)),
        Stmt::ForLoop(l) => {
            target(&l.target, out);
            l.body.iter().for_each(|s| assigned_names(s, out));
            l.else_body.iter().for_each(|s| assigned_names(s, out));
        }
        Stmt::IfCond(c) => {
            c.true_body.iter().for_each(|s| assigned_names(s, out));
            c.false_body.iter().for_each(|s| assigned_names(s, out));
        }
        Stmt::WithBlock(w) => {
            w.assignments.iter().for_each(|(t, _)| target(t, out));
            w.body.iter().for_each(|s| assigned_names(s, out));
        }
        Stmt::Set(s) => target(&s.target, out),
        Stmt::SetBlock(s) => {
            target(&s.target, out);
            s.body.iter().for_each(|s| assigned_names(s, out));
        }
        Stmt::AutoEscape(a) => a.body.iter().for_each(|s| assigned_names(s, out)),
        Stmt::FilterBlock(f) => f.body.iter().for_each(|s| assigned_names(s, out)),
        Stmt::Macro(m) => {
            out.push(m.name);
            m.body.iter().for_each(|s| assigned_names(s, out));
        }
        Stmt::CallBlock(c) => c
            .macro_decl
            .body
            .iter()
            .for_each(|s| assigned_names(s, out)),
        Stmt::Block(b) => b.body.iter().for_each(|s| assigned_names(s, out)),
        Stmt::Import(i) => target(&i.name, out),
        Stmt::FromImport(f) => f.names.iter().for_each(|(name, alias)| {
            target(alias.as_ref().unwrap_or(name), out);
        }),
        Stmt::Extends(_)
        | Stmt::Include(_)
        | Stmt::EmitExpr(_)
        | Stmt::EmitRaw(_)
        | Stmt::Continue(_)
        | Stmt::Break(_)
        | Stmt::Do(_) => {}
    }
}

/// Whether a statement mentions variable `name` anywhere (conservatively: any statement kind
/// not walked counts as mentioning it).
fn stmt_mentions(stmt: &Stmt<'_>, name: &str) -> bool {
    let any = |stmts: &[Stmt<'_>]| stmts.iter().any(|s| stmt_mentions(s, name));
    match stmt {
        Stmt::Template(t) => any(&t.children),
        Stmt::EmitExpr(e) => expr_mentions(&e.expr, name),
        Stmt::EmitRaw(_) | Stmt::Continue(_) | Stmt::Break(_) => false,
        Stmt::ForLoop(l) => {
            expr_mentions(&l.iter, name)
                || l.filter_expr
                    .as_ref()
                    .is_some_and(|e| expr_mentions(e, name))
                || any(&l.body)
                || any(&l.else_body)
        }
        Stmt::IfCond(c) => expr_mentions(&c.expr, name) || any(&c.true_body) || any(&c.false_body),
        Stmt::WithBlock(w) => {
            w.assignments.iter().any(|(_, e)| expr_mentions(e, name)) || any(&w.body)
        }
        Stmt::Set(s) => expr_mentions(&s.expr, name),
        Stmt::SetBlock(s) => {
            s.filter.as_ref().is_some_and(|e| expr_mentions(e, name)) || any(&s.body)
        }
        Stmt::AutoEscape(a) => expr_mentions(&a.enabled, name) || any(&a.body),
        Stmt::FilterBlock(f) => expr_mentions(&f.filter, name) || any(&f.body),
        Stmt::Macro(m) => m.defaults.iter().any(|e| expr_mentions(e, name)) || any(&m.body),
        Stmt::Block(b) => any(&b.body),
        Stmt::CallBlock(_)
        | Stmt::Do(_)
        | Stmt::Import(_)
        | Stmt::FromImport(_)
        | Stmt::Extends(_)
        | Stmt::Include(_) => true,
    }
}

fn args_mention(args: &[CallArg<'_>], name: &str) -> bool {
    args.iter().any(|a| match a {
        CallArg::Pos(e) | CallArg::Kwarg(_, e) | CallArg::PosSplat(e) | CallArg::KwargSplat(e) => {
            expr_mentions(e, name)
        }
    })
}

fn expr_mentions(expr: &Expr<'_>, name: &str) -> bool {
    let opt = |e: &Option<Expr<'_>>| e.as_ref().is_some_and(|e| expr_mentions(e, name));
    match expr {
        Expr::Var(v) => v.id == name,
        Expr::Const(_) => false,
        Expr::Slice(s) => {
            expr_mentions(&s.expr, name) || opt(&s.start) || opt(&s.stop) || opt(&s.step)
        }
        Expr::UnaryOp(u) => expr_mentions(&u.expr, name),
        Expr::BinOp(b) => expr_mentions(&b.left, name) || expr_mentions(&b.right, name),
        Expr::Compare(c) => {
            expr_mentions(&c.expr, name) || c.ops.iter().any(|o| expr_mentions(&o.expr, name))
        }
        Expr::IfExpr(i) => {
            expr_mentions(&i.test_expr, name)
                || expr_mentions(&i.true_expr, name)
                || opt(&i.false_expr)
        }
        Expr::Filter(f) => opt(&f.expr) || args_mention(&f.args, name),
        Expr::Test(t) => expr_mentions(&t.expr, name) || args_mention(&t.args, name),
        Expr::GetAttr(g) => expr_mentions(&g.expr, name),
        Expr::GetItem(g) => expr_mentions(&g.expr, name) || expr_mentions(&g.subscript_expr, name),
        Expr::Call(c) => expr_mentions(&c.expr, name) || args_mention(&c.args, name),
        Expr::List(l) => l.items.iter().any(|e| expr_mentions(e, name)),
        Expr::Tuple(t) => t.items.iter().any(|e| expr_mentions(e, name)),
        Expr::Map(m) => {
            m.keys.iter().any(|e| expr_mentions(e, name))
                || m.values.iter().any(|e| expr_mentions(e, name))
        }
    }
}

/// The checks on the loop body.
struct Body<'b, 'a> {
    target: &'a str,
    assigned: &'b [&'a str],
}

impl Body<'_, '_> {
    fn stmt(&self, stmt: &Stmt<'_>) -> Result<(), &'static str> {
        match stmt {
            Stmt::EmitRaw(_) | Stmt::Continue(_) => Ok(()),
            Stmt::EmitExpr(e) => self.expr(&e.expr),
            Stmt::IfCond(c) => {
                self.expr(&c.expr)?;
                c.true_body.iter().try_for_each(|s| self.stmt(s))?;
                c.false_body.iter().try_for_each(|s| self.stmt(s))
            }
            _ => Err("the loop body sets, loops, breaks, calls a macro or includes"),
        }
    }

    fn args(&self, args: &[CallArg<'_>]) -> Result<(), &'static str> {
        args.iter().try_for_each(|a| match a {
            CallArg::Pos(e)
            | CallArg::Kwarg(_, e)
            | CallArg::PosSplat(e)
            | CallArg::KwargSplat(e) => self.expr(e),
        })
    }

    fn opt(&self, expr: &Option<Expr<'_>>) -> Result<(), &'static str> {
        expr.as_ref().map_or(Ok(()), |e| self.expr(e))
    }

    fn expr(&self, expr: &Expr<'_>) -> Result<(), &'static str> {
        match expr {
            Expr::Var(v) => self.var(v.id),
            Expr::Const(_) => Ok(()),
            Expr::GetAttr(g) => match &g.expr {
                Expr::Var(v) if v.id == "loop" => {
                    if LOOP_ATTRS.contains(&g.name) {
                        Ok(())
                    } else {
                        Err("the loop body reads loop.last, length, revindex or neighbours")
                    }
                }
                inner => self.expr(inner),
            },
            Expr::Call(c) => {
                match &c.expr {
                    Expr::Var(v) if CALLABLE.contains(&v.id) => {}
                    Expr::GetAttr(g) => self.expr(&g.expr)?,
                    _ => return Err("the loop body calls a function"),
                }
                self.args(&c.args)
            }
            Expr::Slice(s) => {
                self.expr(&s.expr)?;
                self.opt(&s.start)?;
                self.opt(&s.stop)?;
                self.opt(&s.step)
            }
            Expr::UnaryOp(u) => self.expr(&u.expr),
            Expr::BinOp(b) => self.expr(&b.left).and_then(|()| self.expr(&b.right)),
            Expr::Compare(c) => {
                self.expr(&c.expr)?;
                c.ops.iter().try_for_each(|o| self.expr(&o.expr))
            }
            Expr::IfExpr(i) => {
                self.expr(&i.test_expr)?;
                self.expr(&i.true_expr)?;
                self.opt(&i.false_expr)
            }
            Expr::Filter(f) => self.opt(&f.expr).and_then(|()| self.args(&f.args)),
            Expr::Test(t) => self.expr(&t.expr).and_then(|()| self.args(&t.args)),
            Expr::GetItem(g) => self
                .expr(&g.expr)
                .and_then(|()| self.expr(&g.subscript_expr)),
            Expr::List(l) => l.items.iter().try_for_each(|e| self.expr(e)),
            Expr::Tuple(t) => t.items.iter().try_for_each(|e| self.expr(e)),
            Expr::Map(m) => {
                m.keys.iter().try_for_each(|e| self.expr(e))?;
                m.values.iter().try_for_each(|e| self.expr(e))
            }
        }
    }

    fn var(&self, id: &str) -> Result<(), &'static str> {
        if id == self.target {
            Ok(())
        } else if id == "loop" {
            Err("the loop body uses the loop object itself")
        } else if id == "messages" {
            Err("the loop body reads messages")
        } else if self.assigned.contains(&id) {
            Err("the loop body reads a name the template assigns")
        } else if id.starts_with("__continuum") {
            Err("the template uses the rewrite's names")
        } else {
            Ok(())
        }
    }
}

/// `{%`, its whitespace marker (`-`, `+` or none), and the tag's words; or `None`.
fn tag(text: &str) -> Option<(&str, &str, Vec<&str>)> {
    let inner = text.strip_prefix("{%")?.strip_suffix("%}")?;
    let (open, inner) = match inner.as_bytes().first() {
        Some(b'-') => ("-", &inner[1..]),
        Some(b'+') => ("+", &inner[1..]),
        _ => ("", inner),
    };
    let (close, inner) = match inner.as_bytes().last() {
        Some(b'-') => ("-", &inner[..inner.len() - 1]),
        Some(b'+') => ("+", &inner[..inner.len() - 1]),
        _ => ("", inner),
    };
    Some((open, close, inner.split_whitespace().collect()))
}

/// The source with the loop whose span is `start..end` wrapped: a start mark before it, a skip
/// of the first iterations inside it, an end mark after it. The tags are found from the span
/// and checked word by word, so a span that is not what it seems refuses the rewrite.
fn splice(source: &str, start: usize, end: usize, target: &str) -> Result<String, &'static str> {
    let start = if source[start..].starts_with("{%") {
        start
    } else {
        source[..start].rfind("{%").ok_or("no for tag")?
    };
    let for_end = source[start..].find("%}").ok_or("no for tag")? + start + 2;
    let endfor_start = source[..end].rfind("{%").ok_or("no endfor tag")?;
    let endfor_end = source[endfor_start..].find("%}").ok_or("no endfor")? + endfor_start + 2;
    let (for_open, for_close, words) = tag(&source[start..for_end]).ok_or("odd for tag")?;
    if words != ["for", target, "in", "messages"] {
        return Err("the for tag is not `for NAME in messages`");
    }
    let (_, end_close, words) = tag(&source[endfor_start..endfor_end]).ok_or("odd endfor")?;
    if words != ["endfor"] || endfor_start < for_end {
        return Err("the loop does not end with a plain endfor");
    }
    let mut out = String::with_capacity(source.len() + 256);
    out.push_str(&source[..start]);
    out.push_str(&format!(
        "{{%{for_open} if true %}}{{{{ {START_VAR} }}}}{{% endif %}}"
    ));
    out.push_str(&source[start..for_end]);
    out.push_str(&format!(
        "{{% if loop.index0 < {FROM_VAR} %}}{{% continue %}}{{% endif {for_close}%}}"
    ));
    out.push_str(&source[for_end..endfor_end]);
    out.push_str(&format!(
        "{{% if true %}}{{{{ {END_VAR} }}}}{{% endif {end_close}%}}"
    ));
    out.push_str(&source[endfor_end..]);
    Ok(out)
}

#[cfg(test)]
mod tests;
