// Checks of the AWS Terraform module: the HCL parsed with @cdktf/hcl2json and held to
// the security contract (private bucket, encryption, least privilege), plus terraform
// fmt / init / validate / test run offline through the provider mirror when present.

// biome-ignore-all lint/suspicious/noTemplateCurlyInString: HCL interpolations like ${var.x} are expected data here

import { spawnSync } from 'node:child_process'
import { cpSync, existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { parse } from '@cdktf/hcl2json'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'

const MODULE_DIR = join(import.meta.dirname, '..', 'infra', 'terraform', 'aws')
const EXAMPLE_DIR = join(MODULE_DIR, 'examples', 'basic')
const MIRROR = process.env.KVGATE_TF_MIRROR ?? '/opt/tf-plugins'

// biome-ignore lint/suspicious/noExplicitAny: hcl2json's output is untyped JSON
type Hcl = Record<string, any>

/** Parses every .tf file of a directory into one object (blocks of the same kind merged). */
async function parseDir(dir: string): Promise<Hcl> {
  const merged: Hcl = {}
  for (const f of readdirSync(dir)
    .filter((n) => n.endsWith('.tf'))
    .sort()) {
    const json = await parse(f, readFileSync(join(dir, f), 'utf8'))
    for (const [kind, blocks] of Object.entries(json)) {
      if (Array.isArray(blocks)) merged[kind] = [...(merged[kind] ?? []), ...blocks]
      else merged[kind] = deepMerge(merged[kind] ?? {}, blocks as Hcl)
    }
  }
  return merged
}

function deepMerge(a: Hcl, b: Hcl): Hcl {
  const out: Hcl = { ...a }
  for (const [k, v] of Object.entries(b)) {
    out[k] = out[k] && typeof v === 'object' && !Array.isArray(v) ? deepMerge(out[k], v) : v
  }
  return out
}

interface Statement {
  sid?: string
  effect?: string
  actions?: string[]
  resources?: string[]
}

/** All statements of a policy document data source, including those produced by dynamic blocks. */
function statementsOf(doc: Hcl): Statement[] {
  const out: Statement[] = [...(doc.statement ?? [])]
  for (const dyn of doc.dynamic?.statement ?? []) out.push(...(dyn.content ?? []))
  return out
}

const ALLOWED_ACTIONS = new Set([
  's3:GetObject',
  's3:PutObject',
  's3:DeleteObject',
  's3:AbortMultipartUpload',
  's3:ListMultipartUploadParts',
  's3:ListBucket',
  'ssm:GetParameter',
  'logs:CreateLogStream',
  'logs:PutLogEvents',
  'kms:Decrypt',
  'kms:GenerateDataKey',
])

// The only wildcards allowed: "every object under the chunk prefix", "every staged upload"
// and "every stream of our log group".
const SCOPED_WILDCARD_RESOURCES = new Set([
  '${local.objects_arn}',
  '${local.staging_arn}',
  '${aws_cloudwatch_log_group.this.arn}:log-stream:*',
])

/** Least-privilege violations of the gateway role's policy; empty when it is sound. */
function iamViolations(hcl: Hcl): string[] {
  const problems: string[] = []
  const doc = hcl.data?.aws_iam_policy_document?.gateway?.[0]
  if (!doc) return ['no data.aws_iam_policy_document.gateway']
  const attached = hcl.resource?.aws_iam_role_policy?.this?.[0]?.policy
  if (attached !== '${data.aws_iam_policy_document.gateway.json}')
    problems.push('role policy is not the gateway document')
  if (hcl.resource?.aws_iam_role_policy_attachment)
    problems.push('managed policy attachments grant more than listed')
  for (const st of statementsOf(doc)) {
    // The one Deny: presigned (query-string) writes to the chunk prefix.
    if (st.sid === 'NoPresignedChunkWrites' && st.effect === 'Deny') continue
    if (st.effect !== 'Allow') problems.push(`${st.sid}: unexpected effect ${st.effect}`)
    for (const a of st.actions ?? []) {
      if (a.includes('*')) problems.push(`${st.sid}: wildcard action ${a}`)
      else if (!ALLOWED_ACTIONS.has(a)) problems.push(`${st.sid}: action ${a} not in the allowed list`)
    }
    if ((st.actions ?? []).length === 0) problems.push(`${st.sid}: no actions`)
    for (const r of st.resources ?? []) {
      if (r.includes('*') && !SCOPED_WILDCARD_RESOURCES.has(r))
        problems.push(`${st.sid}: wildcard resource ${r}`)
    }
    if ((st.resources ?? []).length === 0) problems.push(`${st.sid}: no resources (would mean "*")`)
    const s3Actions = (st.actions ?? []).filter((a) => a.startsWith('s3:'))
    if (s3Actions.length > 0) {
      const onBucket = s3Actions.every((a) => a === 's3:ListBucket')
      const want = onBucket
        ? ['${aws_s3_bucket.this.arn}']
        : st.sid === 'StagedUploads'
          ? ['${local.staging_arn}']
          : ['${local.objects_arn}']
      if (JSON.stringify(st.resources) !== JSON.stringify(want))
        problems.push(`${st.sid}: s3 resources ${st.resources}`)
    }
  }
  const locals: Hcl = Object.assign({}, ...(hcl.locals ?? []))
  if (locals.objects_arn !== '${aws_s3_bucket.this.arn}/${var.object_prefix}/*') {
    problems.push(`objects_arn is ${locals.objects_arn}, not the bucket's chunk prefix`)
  }
  // Only the gateway's staging prefix may take presigned writes, and it lies outside the chunks.
  const staging = statementsOf(doc).find((s) => s.sid === 'StagedUploads')
  if (staging && locals.staging_arn !== '${aws_s3_bucket.this.arn}/${local.staging_prefix}/*')
    problems.push(`staging_arn is ${locals.staging_arn}, not the staging prefix`)
  if (staging && locals.staging_prefix !== '${var.object_prefix}-staging')
    problems.push(`staging_prefix ${locals.staging_prefix} is not beside the chunk prefix`)
  return problems
}

function bucketViolations(hcl: Hcl): string[] {
  const problems: string[] = []
  const r = hcl.resource ?? {}
  const pab = r.aws_s3_bucket_public_access_block?.this?.[0]
  for (const k of [
    'block_public_acls',
    'block_public_policy',
    'ignore_public_acls',
    'restrict_public_buckets',
  ]) {
    if (pab?.[k] !== true) problems.push(`public access block ${k} is ${pab?.[k]}`)
  }
  if (pab?.bucket !== '${aws_s3_bucket.this.id}') problems.push('public access block not on the bucket')
  const own = r.aws_s3_bucket_ownership_controls?.this?.[0]?.rule?.[0]?.object_ownership
  if (own !== 'BucketOwnerEnforced') problems.push(`object ownership ${own}`)
  if (r.aws_s3_bucket_acl) problems.push('bucket ACLs are defined')
  const bucket = r.aws_s3_bucket?.this?.[0] ?? {}
  if ('acl' in bucket || 'policy' in bucket) problems.push('inline acl/policy on the bucket')
  const deny = statementsOf(hcl.data?.aws_iam_policy_document?.bucket?.[0] ?? {}).find(
    (s) => s.effect === 'Deny' && (s as Hcl).condition?.[0]?.variable === 'aws:SecureTransport',
  ) as Hcl | undefined
  if (deny?.condition[0].values[0] !== 'false') problems.push('no TLS-only deny statement')
  if (r.aws_s3_bucket_policy?.this?.[0]?.policy !== '${data.aws_iam_policy_document.bucket.json}') {
    problems.push('bucket policy is not the TLS-only document')
  }
  const allowsInBucketPolicy = statementsOf(hcl.data?.aws_iam_policy_document?.bucket?.[0] ?? {}).filter(
    (s) => s.effect !== 'Deny',
  )
  if (allowsInBucketPolicy.length > 0) problems.push('bucket policy grants access')
  const sse = r.aws_s3_bucket_server_side_encryption_configuration?.this?.[0]?.rule?.[0]
  const algo: string = sse?.apply_server_side_encryption_by_default?.[0]?.sse_algorithm ?? ''
  if (!algo.includes('"AES256"') || !algo.includes('"aws:kms"')) problems.push(`sse_algorithm ${algo}`)
  return problems
}

let hcl: Hcl
let example: Hcl
beforeAll(async () => {
  hcl = await parseDir(MODULE_DIR)
  example = await parseDir(EXAMPLE_DIR)
})

describe('terraform module structure (hcl2json)', () => {
  it('keeps the bucket private, encrypted and TLS-only', () => {
    expect(bucketViolations(hcl)).toEqual([])
  })

  it('grants the function only the listed actions on the bucket, its parameter and its log group', () => {
    expect(iamViolations(hcl)).toEqual([])
    const actions = statementsOf(hcl.data.aws_iam_policy_document.gateway[0]).flatMap((s) => s.actions ?? [])
    for (const a of [
      's3:GetObject',
      's3:PutObject',
      's3:DeleteObject',
      's3:ListBucket',
      's3:AbortMultipartUpload',
    ]) {
      expect(actions).toContain(a)
    }
  })

  it('lets presigned uploads write only the staging prefix, expires what was never committed, and has no CORS', () => {
    const sts = statementsOf(hcl.data.aws_iam_policy_document.gateway[0]) as Hcl[]
    const staged = sts.find((s) => s.sid === 'StagedUploads')
    expect(staged?.resources).toEqual(['${local.staging_arn}'])
    expect([...(staged?.actions ?? [])].sort()).toEqual([
      's3:AbortMultipartUpload',
      's3:DeleteObject',
      's3:GetObject',
      's3:ListMultipartUploadParts',
      's3:PutObject',
    ])
    const deny = sts.find((s) => s.sid === 'NoPresignedChunkWrites')
    expect(deny?.effect).toBe('Deny')
    expect(deny?.resources).toEqual(['${local.objects_arn}'])
    expect(deny?.condition[0]).toEqual({
      test: 'StringEquals',
      variable: 's3:authType',
      values: ['REST-QUERY-STRING'],
    })
    const rules = hcl.resource.aws_s3_bucket_lifecycle_configuration.this[0].rule as Hcl[]
    const staging = rules.find((r) => r.id === 'kv-upload-staging')
    expect(staging?.filter[0].prefix).toBe('${local.staging_prefix}/')
    expect(staging?.expiration[0].days).toBe('${var.staging_expiration_days}')
    expect(hcl.variable.staging_expiration_days[0].default).toBe(1)
    const vars = hcl.resource.aws_lambda_function.this[0].environment[0].variables
    expect(vars.KVGATE_STAGING_PREFIX).toBe('${local.staging_prefix}')
    expect(vars.KVGATE_UPLOAD_TTL).toBe('${tostring(var.upload_ttl_seconds)}')
    // Clients upload with plain HTTP clients, not browsers: no CORS configuration at all.
    expect(hcl.resource.aws_s3_bucket_cors_configuration).toBeUndefined()
    expect(JSON.stringify(hcl.resource.aws_s3_bucket)).not.toMatch(/cors/)
  })

  it('flags hostile policies (the checks themselves can fail)', async () => {
    const bad = await parse(
      'bad.tf',
      `locals { objects_arn = "\${aws_s3_bucket.this.arn}/*" }
       data "aws_iam_policy_document" "gateway" {
         statement {
           effect    = "Allow"
           actions   = ["s3:*", "iam:PassRole"]
           resources = ["*"]
         }
       }
       resource "aws_iam_role_policy" "this" { policy = data.aws_iam_policy_document.gateway.json }
       resource "aws_s3_bucket_public_access_block" "this" {
         bucket = aws_s3_bucket.this.id
         block_public_acls = true
         block_public_policy = false
       }`,
    )
    const iam = iamViolations(bad).join('\n')
    expect(iam).toMatch(/wildcard action s3:\*/)
    expect(iam).toMatch(/iam:PassRole not in the allowed list/)
    expect(iam).toMatch(/wildcard resource \*/)
    expect(iam).toMatch(/objects_arn/)
    const bucket = bucketViolations(bad).join('\n')
    expect(bucket).toMatch(/block_public_policy is false/)
    expect(bucket).toMatch(/no TLS-only deny/)
    expect(bucket).toMatch(/sse_algorithm/)
  })

  it('has cold-tier lifecycle rules: transition, expiry and multipart abort, all driven by variables', () => {
    const rules = hcl.resource.aws_s3_bucket_lifecycle_configuration.this[0].rule as Hcl[]
    const cold = rules.find((r) => r.id === 'kv-cold-tier')
    expect(cold?.status).toBe('Enabled')
    expect(cold?.filter[0].prefix).toBe('${var.object_prefix}/')
    expect(cold?.dynamic.transition[0].content[0]).toEqual({
      days: '${transition.value}',
      storage_class: '${var.cold_tier_storage_class}',
    })
    expect(cold?.dynamic.transition[0].for_each).toContain('var.cold_tier_transition_days')
    expect(cold?.dynamic.expiration[0].for_each).toContain('var.expiration_days')
    for (const r of rules) {
      expect(r.abort_incomplete_multipart_upload[0].days_after_initiation).toBe(
        '${var.abort_incomplete_multipart_days}',
      )
    }
    expect(hcl.variable.cold_tier_transition_days[0].default).toBe(30)
    expect(hcl.variable.expiration_days[0].default).toBe(180)
  })

  it('runs the function on nodejs22.x arm64 behind a streaming URL, with log retention', () => {
    const fn = hcl.resource.aws_lambda_function.this[0]
    expect(fn.runtime).toBe('nodejs22.x')
    expect(fn.architectures).toEqual(['${var.lambda_architecture}'])
    expect(hcl.variable.lambda_architecture[0].default).toBe('arm64')
    expect(fn.source_code_hash).toBe('${filebase64sha256(var.lambda_zip_path)}')
    expect(Object.keys(fn.environment[0].variables)).toEqual(
      expect.arrayContaining(['KVGATE_S3_BUCKET', 'KVGATE_S3_PREFIX', 'KVGATE_AUTH_SSM_PARAMETER']),
    )
    expect(hcl.resource.aws_lambda_function_url.this[0].invoke_mode).toBe('RESPONSE_STREAM')
    const logs = hcl.resource.aws_cloudwatch_log_group.this[0]
    expect(logs.retention_in_days).toBe('${var.log_retention_days}')
    expect(fn.logging_config[0].log_group).toBe('${aws_cloudwatch_log_group.this.name}')
    expect(hcl.resource.aws_ssm_parameter.this[0].type).toBe('SecureString')
    // The only public grants: invoking through the URL (both actions AWS requires since 10/2025).
    const locals: Hcl = Object.assign({}, ...hcl.locals)
    const grants = Object.values(locals.url_permissions as Record<string, { action: string }>).map(
      (p) => p.action,
    )
    expect(grants.sort()).toEqual(['lambda:InvokeFunction', 'lambda:InvokeFunctionUrl'])
    const principals = Object.values(locals.url_permissions as Record<string, { principal: string }>)
    expect(principals.map((p) => p.principal)).toEqual(['*', '*'])
    expect(hcl.resource.aws_lambda_permission.this[0].principal).toBe('${each.value.principal}')
  })

  it('schedules kvgate gc through EventBridge, scoped to its rule, with the namespace policies', () => {
    const locals: Hcl = Object.assign({}, ...hcl.locals)
    const rule = hcl.resource.aws_cloudwatch_event_rule.this[0]
    expect(rule.schedule_expression).toBe('${var.gc_schedule_expression}')
    expect(hcl.variable.gc_schedule_expression[0].default).toBe('rate(1 hour)')
    const target = hcl.resource.aws_cloudwatch_event_target.this[0]
    expect(target.arn).toBe('${aws_lambda_function.this.arn}')
    expect(target.input).toBe('${jsonencode({ kvgate = "gc" })}')
    // Only EventBridge, only from this rule, may invoke it outside the URL.
    const gc = locals.gc_permissions as string
    expect(gc).toContain('events.amazonaws.com')
    expect(gc).toContain('aws_cloudwatch_event_rule.this[0].arn')
    expect(hcl.resource.aws_lambda_permission.this[0].source_arn).toBe('${each.value.source_arn}')
    const env = hcl.resource.aws_lambda_function.this[0].environment[0].variables
    expect(env.KVGATE_COLD_TIER).toBe('${local.cold_tier_json}')
    expect(hcl.variable.namespace_policies[0].default).toEqual({})
    expect(hcl.variable.cold_tier_storage_class[0].validation[0].condition).toContain('INTELLIGENT_TIERING')
  })

  it('follows the module conventions: typed, described variables; resources named this; pinned versions', () => {
    for (const [name, [v]] of Object.entries(hcl.variable as Record<string, Hcl[]>)) {
      expect(v?.type, `variable ${name} type`).toBeTruthy()
      expect(String(v?.description ?? '').length, `variable ${name} description`).toBeGreaterThan(10)
    }
    for (const [kind, byName] of Object.entries(hcl.resource as Record<string, Hcl>)) {
      expect(Object.keys(byName), kind).toEqual(['this'])
    }
    for (const [name, [o]] of Object.entries(hcl.output as Record<string, Hcl[]>)) {
      expect(String(o?.description ?? ''), `output ${name}`).not.toBe('')
    }
    expect(Object.keys(hcl.output)).toEqual(
      expect.arrayContaining(['function_url', 'bucket_name', 'bucket_arn']),
    )
    const tf = hcl.terraform[0]
    expect(tf.required_version).toMatch(/^>= 1\.\d+\.\d+, < 2\.0\.0$/)
    expect(tf.required_providers[0].aws.version).toBe('>= 5.100.0, < 6.0.0')
    expect(example.terraform[0].required_providers[0].aws.version).toBe('5.100.0')
    expect(example.module.kvgate[0].source).toBe('../..')
  })
})

const terraform = spawnSync('terraform', ['version'], { encoding: 'utf8' })
const haveTerraform = terraform.status === 0
const haveMirror = existsSync(join(MIRROR, 'registry.terraform.io', 'hashicorp', 'aws'))
if (!haveTerraform) console.warn('terraform.test: terraform not on PATH, skipping fmt/validate')
else if (!haveMirror)
  console.warn(`terraform.test: no provider mirror at ${MIRROR}, skipping init/validate/test`)

describe.skipIf(!haveTerraform)('terraform CLI', () => {
  // Everything runs on a copy in a temp dir: init writes .terraform.lock.hcl beside the config.
  let work: string
  let env: NodeJS.ProcessEnv
  beforeAll(() => {
    work = mkdtempSync(join(tmpdir(), 'kvgate-tf-'))
    cpSync(MODULE_DIR, join(work, 'aws'), { recursive: true })
    const cli = join(work, 'cli.tfrc')
    writeFileSync(
      cli,
      `provider_installation {
  filesystem_mirror {
    path = ${JSON.stringify(MIRROR)}
  }
  direct {
    exclude = ["registry.terraform.io/*/*"]
  }
}
`,
    )
    env = { ...process.env, TF_CLI_CONFIG_FILE: cli, TF_IN_AUTOMATION: '1', CHECKPOINT_DISABLE: '1' }
    delete env.TF_WORKSPACE
  })
  afterAll(() => {
    if (work) rmSync(work, { recursive: true, force: true })
  })

  function tf(cwd: string, dataDir: string, ...args: string[]) {
    const r = spawnSync('terraform', [...args, '-no-color'], {
      cwd,
      env: { ...env, TF_DATA_DIR: join(work, dataDir) },
      encoding: 'utf8',
    })
    return { code: r.status, out: `${r.stdout}${r.stderr}` }
  }

  it('is terraform fmt clean', () => {
    const r = spawnSync('terraform', ['fmt', '-check', '-recursive', '-diff', '-no-color', MODULE_DIR], {
      encoding: 'utf8',
      env,
    })
    expect(`${r.stdout}${r.stderr}`).toBe('')
    expect(r.status).toBe(0)
  })

  it.skipIf(!haveMirror)(
    'inits and validates the module offline, and its mocked plan tests pass',
    () => {
      const dir = join(work, 'aws')
      const init = tf(dir, 'module', 'init', '-backend=false', '-input=false')
      expect(init.code, init.out).toBe(0)
      const v = tf(dir, 'module', 'validate')
      expect(v.code, v.out).toBe(0)
      expect(v.out).toMatch(/configuration is valid/)
      const t = tf(dir, 'module', 'test')
      expect(t.code, t.out).toBe(0)
      expect(t.out).toMatch(/\d+ passed, 0 failed/)
      // 14 mocked plans: past a minute on a loaded 2-core machine.
    },
    300_000,
  )

  it.skipIf(!haveMirror)('inits and validates examples/basic offline', () => {
    const dir = join(work, 'aws', 'examples', 'basic')
    const init = tf(dir, 'example', 'init', '-backend=false', '-input=false')
    expect(init.code, init.out).toBe(0)
    const v = tf(dir, 'example', 'validate')
    expect(v.code, v.out).toBe(0)
    expect(v.out).toMatch(/configuration is valid/)
  })
})
