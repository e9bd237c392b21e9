// Where page modules name a kind of sample (tests/test_architecture.py runs this): every string literal that is a
// kind's name ('image', "next-word", `sensor`) and every object key that is one ({sensor: ...}, a lookup by kind),
// found by TypeScript's parser, so comments, regular expressions and longer strings ('image/*') are not counted.
// Usage: node kind_branches.mjs KIND[,KIND...] FILE...; prints JSON: [[file, line, text], ...].

import { readFileSync } from 'node:fs';
import ts from 'typescript';

const [names, ...files] = process.argv.slice(2);
const kinds = new Set(names.split(','));
const found = [];
for (const file of files) {
  const source = ts.createSourceFile(file, readFileSync(file, 'utf8'), ts.ScriptTarget.Latest, true);
  const visit = (node) => {
    const named =
      ts.isPropertyAssignment(node) || ts.isMethodDeclaration(node) || ts.isShorthandPropertyAssignment(node);
    const isKey = node.parent && named === false && ts.isPropertyAssignment(node.parent) && node.parent.name === node;
    const literal = (ts.isStringLiteral(node) || ts.isNoSubstitutionTemplateLiteral(node)) && !isKey;
    const key = named && (ts.isIdentifier(node.name) || ts.isStringLiteral(node.name)) ? node.name.text : null;
    if ((literal && kinds.has(node.text)) || (key !== null && kinds.has(key))) {
      const { line } = source.getLineAndCharacterOfPosition(node.getStart(source));
      found.push([file, line + 1, node.getText(source).split('\n')[0]]);
    }
    ts.forEachChild(node, visit);
  };
  visit(source);
}
process.stdout.write(JSON.stringify(found));
